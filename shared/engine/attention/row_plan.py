"""Per-row view of a step for the native backends: each query row attends to a prefix of its
sequence's paged context.

A decode row sees all of its context; the prefill row at position p sees its first p + 1
tokens, which makes one kernel serve decodes and varlen prefill chunks (over a cached
prefix or not) alike. Built once per step from the metadata, reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class RowPlan:
    block_tables: torch.Tensor  # [D + P, max_blocks] int64: decode tables, then one per chunk
    row_table: torch.Tensor  # [T] int64: table row of each query row
    row_context: torch.Tensor  # [T] int64: context tokens each query row sees

    def to(self, device: torch.device) -> RowPlan:
        return RowPlan(
            *(t.to(device) for t in (self.block_tables, self.row_table, self.row_context))
        )


def plan_rows(meta: AttentionMetadata, block_size: int) -> RowPlan:
    """The plan, on the device of the metadata's tensors."""
    d_rows, device = meta.num_decodes, meta.slot_mapping.device
    tables = [meta.decode_block_tables.view(d_rows, -1)] if d_rows else []
    tables += [chunk.block_table.view(1, -1) for chunk in meta.prefills]
    width = max(t.shape[1] for t in tables)
    block_tables = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
    row_table = [torch.arange(d_rows, device=device)]
    row_context = [decode_lengths(meta, block_size)]
    for i, chunk in enumerate(meta.prefills):
        row_table.append(torch.full((chunk.query_len,), d_rows + i, device=device))
        first = chunk.context_len - chunk.query_len + 1  # context of the chunk's first row
        row_context.append(torch.arange(first, chunk.context_len + 1, device=device))
    return RowPlan(block_tables, torch.cat(row_table), torch.cat(row_context))


def decode_lengths(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """[D] int64 context lengths, read back from the mask (no mask: every slot is valid)."""
    d_rows = meta.num_decodes
    if meta.decode_mask is None:
        width = meta.decode_block_tables.shape[-1] * block_size
        return torch.full((d_rows,), width, device=meta.decode_block_tables.device)
    return meta.decode_mask.view(d_rows, -1).sum(dim=1)
