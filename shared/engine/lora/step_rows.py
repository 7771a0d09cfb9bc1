"""Which adapter each row of a step's flat batch is multiplied by, for the two row counts a
layer's matrices see: every token row, and (after the last layer's attention) only the rows
whose logits are wanted (DecoderModel.rows_kept_after).

The one rule: a row's adapter is its request's, whatever rows share its step; the products
(stacked.py) take each row by its own slot, so a row's result never depends on the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

BASE_SLOT = -1  # a row of the base model: nothing added


@dataclass(slots=True, frozen=True)
class StepRows:
    spans: list[tuple[str, int, int]]  # (adapter, tokens, logits rows: its last ones); "": base

    @property
    def adapters(self) -> list[str]:
        """The step's adapters, once each, in batch order."""
        return list(dict.fromkeys(adapter for adapter, _, _ in self.spans if adapter))

    def slots(self, slot_of: Mapping[str, int]) -> SlotRows:
        """Each row's slot, given where each adapter of the step is."""
        every: list[int] = []
        kept: list[int] = []
        for adapter, num_tokens, num_logits in self.spans:
            slot = slot_of[adapter] if adapter else BASE_SLOT
            every += [slot] * num_tokens
            kept += [slot] * num_logits
        return SlotRows(_int32(every), _int32(kept))


@dataclass(slots=True, frozen=True)
class SlotRows:
    """[rows] int32 on the host: each row's slot, BASE_SLOT for the base model's."""

    every: torch.Tensor  # the step's token rows
    kept: torch.Tensor  # its logits rows

    def of(self, num_rows: int) -> torch.Tensor:
        """The slots of a matmul over `num_rows` rows: every row of the step, or the kept."""
        if num_rows == self.every.shape[0]:
            return self.every
        assert num_rows == self.kept.shape[0], f"{num_rows} rows: neither the step's nor its kept"
        return self.kept


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)
