"""Per-step attention metadata: where each new token's KV goes, and what each query sees.

The batch is one flat list of T new tokens with no padding: first the D decode tokens (one
per sequence), then each prefill chunk in turn. Built once per step, shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # first row of this chunk in the flat batch
    query_len: int  # new tokens in this chunk
    context_len: int  # tokens the chunk attends to: cached prefix + earlier chunks + itself
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    num_decodes: int  # D: rows [0, D) are single-token decodes
    decode_block_tables: torch.Tensor  # [D, max_blocks] int64, padded with block 0
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool; None if D <= 1
    prefills: list[PrefillChunk]
