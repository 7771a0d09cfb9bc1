"""Which rows of a step's flat batch belong to which adapter, for the two row counts a
layer's matrices see: every token row, and (after the last layer's attention) only the rows
whose logits are wanted (DecoderModel.rows_kept_after). A group is a list of row slices:
the scheduler puts one adapter's decodes side by side and a prompt chunk is contiguous, so
a group is a few slices, read as views and added back in place (no gather, no scatter).

The one rule: a group's rows are multiplied by that adapter alone and added back where they
came from, so a row's result never depends on which other rows share its step (each
product is a batch-invariant kernel call over some rows; docs/lora.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class RowGroup:
    adapter: str
    slices: list[slice]  # its rows, in order; adjacent ones merged


@dataclass(slots=True, frozen=True)
class StepRows:
    num_rows: int  # token rows of the step
    num_kept: int  # logits rows of the step
    all_rows: list[RowGroup]
    kept_rows: list[RowGroup]

    @classmethod
    def of(cls, spans: list[tuple[str, int, int]]) -> StepRows:
        """spans: (adapter, tokens, logits rows: its last ones) in batch order; "" is the
        base model, which has no group."""
        full: dict[str, list[slice]] = {}
        kept: dict[str, list[slice]] = {}
        row = kept_row = 0
        for adapter, num_tokens, num_logits in spans:
            if adapter:
                _extend(full.setdefault(adapter, []), row, row + num_tokens)
                _extend(kept.setdefault(adapter, []), kept_row, kept_row + num_logits)
            row += num_tokens
            kept_row += num_logits
        return cls(
            row,
            kept_row,
            [RowGroup(a, s) for a, s in full.items()],
            [RowGroup(a, s) for a, s in kept.items() if s],
        )

    @property
    def adapters(self) -> list[str]:
        return [group.adapter for group in self.all_rows]

    def groups(self, num_rows: int) -> list[RowGroup]:
        """The groups of a matmul over `num_rows` rows: every row of the step or the kept."""
        if num_rows == self.num_rows:
            return self.all_rows
        assert num_rows == self.num_kept, f"{num_rows} rows: neither the step's nor its kept"
        return self.kept_rows


def _extend(slices: list[slice], start: int, stop: int) -> None:
    """Append rows [start, stop), merged into the last slice when they follow it."""
    if start == stop:
        return
    if slices and slices[-1].stop == start:
        slices[-1] = slice(slices[-1].start, stop)
    else:
        slices.append(slice(start, stop))
