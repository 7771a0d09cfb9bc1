"""Which rows of a step's flat batch belong to which adapter, for the two row counts a
layer's matrices see: every token row, and (after the last layer's attention) only the rows
whose logits are wanted (DecoderModel.rows_kept_after).

The one rule: a group's rows are gathered, multiplied by that adapter alone and added back
in place, so a row's result never depends on which other rows share its step (each product
is one batch-invariant kernel call per row set; docs/lora.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class RowGroup:
    adapter: str
    rows: torch.Tensor | None  # [n] int64 row indices; None: every row of the call


@dataclass(slots=True, frozen=True)
class StepRows:
    num_rows: int  # token rows of the step
    num_kept: int  # logits rows of the step
    all_rows: list[RowGroup]
    kept_rows: list[RowGroup]

    @classmethod
    def of(cls, spans: list[tuple[str, int, int]], device: torch.device) -> StepRows:
        """spans: (adapter, tokens, logits rows: its last ones) in batch order; "" is the
        base model, which has no group."""
        full: dict[str, list[int]] = {}
        kept: dict[str, list[int]] = {}
        row = kept_row = 0
        for adapter, num_tokens, num_logits in spans:
            if adapter:
                full.setdefault(adapter, []).extend(range(row, row + num_tokens))
                kept.setdefault(adapter, []).extend(range(kept_row, kept_row + num_logits))
            row += num_tokens
            kept_row += num_logits
        return cls(row, kept_row, _groups(full, row, device), _groups(kept, kept_row, device))

    @property
    def adapters(self) -> list[str]:
        return [group.adapter for group in self.all_rows]

    def groups(self, num_rows: int) -> list[RowGroup]:
        """The groups of a matmul over `num_rows` rows: every row of the step or the kept."""
        if num_rows == self.num_rows:
            return self.all_rows
        assert num_rows == self.num_kept, f"{num_rows} rows: neither the step's nor its kept"
        return self.kept_rows


def _groups(rows: dict[str, list[int]], total: int, device: torch.device) -> list[RowGroup]:
    return [
        RowGroup(
            adapter,
            None
            if len(indices) == total
            else torch.tensor(indices, dtype=torch.int64).to(device, non_blocking=True),
        )
        for adapter, indices in rows.items()
        if indices
    ]
