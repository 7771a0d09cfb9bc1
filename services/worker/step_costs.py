"""A worker's step costs, measured where each step is timed (the engine thread) for the
scheduler's path choice (services/scheduler/path_cost.py).

- prefill rate = EWMA(prompt tokens of a step) / EWMA(seconds of the same steps), over the
  steps that computed prompt tokens: a ratio of averages, so a step of many tokens weighs
  more than one of a few, and a short step's fixed cost does not pass for a slow rate.
- decode step = EWMA of the seconds of steps that computed no prompt token, with the EWMA of
  their rows (a step time means little without the batch it was measured at); and the
  seconds one more row adds to such a step: the slope of seconds on rows, fitted over the
  last few hundred of them (0 while their rows have not varied enough to fit a slope): the
  planner's streams per worker within the TPOT objective (services/planner/demand.py).
- busy = seconds spent in steps since start; `BusyShare` turns it into the share of each
  heartbeat interval.
- stall = the seconds running streams waited on prompt work beyond a decode step (steps
  that computed prompt tokens and decode rows together), summed and decayed by the step time
  that follows with a STALL_HORIZON_S time constant: what the streams of the recent past have
  taken, for the path choice's TPOT prediction (services/scheduler/path_slo.py).

The one subtle rule: the engine thread writes and the loop reads, without a lock: every
step replaces `current` whole (one reference assignment) with a frozen `StepCosts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.engine.stats import StepCosts

ALPHA = 0.2  # weight of the newest step in each average: about the last ten steps count
SLOPE_ALPHA = 0.005  # the row-cost fit's weight per step: about the last 200 decode steps
MIN_ROWS_VARIANCE = 0.25  # rows must vary this much (rows²) before a slope is fitted
STALL_HORIZON_S = 10.0  # a stall's weight falls by e over this much step time (a stream's life)


@dataclass(slots=True)
class Ewma:
    alpha: float = ALPHA
    value: float = 0.0
    seen: bool = False

    def add(self, sample: float) -> None:
        self.value = self.value + self.alpha * (sample - self.value) if self.seen else sample
        self.seen = True


class RowCost:
    """Seconds per decode row: the least-squares slope of step seconds on rows, over
    exponentially weighted moments (0.0 until the rows have varied)."""

    def __init__(self, alpha: float = SLOPE_ALPHA) -> None:
        self._moments = [Ewma(alpha) for _ in range(4)]  # rows, seconds, rows², rows × seconds

    def add(self, rows: int, seconds: float) -> None:
        samples = (rows, seconds, rows * rows, rows * seconds)
        for moment, sample in zip(self._moments, samples, strict=True):
            moment.add(sample)

    @property
    def slope(self) -> float:
        rows, seconds, rows2, cross = (m.value for m in self._moments)
        variance = rows2 - rows * rows
        if variance < MIN_ROWS_VARIANCE:
            return 0.0
        return max(0.0, (cross - rows * seconds) / variance)


class StepTimer:
    """Fed one step at a time by the engine thread; `current` is what heartbeats read."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self._prompt_tokens = Ewma(alpha)
        self._prompt_seconds = Ewma(alpha)
        self._decode_seconds = Ewma(alpha)
        self._decode_rows = Ewma(alpha)
        self._row_cost = RowCost()
        self._busy = 0.0
        self._stall = 0.0
        self.current = StepCosts()

    def observe(self, seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        """One step that took `seconds` (a step that scheduled nothing is no measure)."""
        if not (prompt_tokens or decode_rows):
            return
        self._busy += seconds
        self._stall *= math.exp(-seconds / STALL_HORIZON_S)
        if prompt_tokens and decode_rows:
            self._stall += max(0.0, seconds - self._decode_seconds.value)
        if prompt_tokens:
            self._prompt_tokens.add(prompt_tokens)
            self._prompt_seconds.add(seconds)
        else:
            self._decode_seconds.add(seconds)
            self._decode_rows.add(decode_rows)
            self._row_cost.add(decode_rows, seconds)
        rate = (
            self._prompt_tokens.value / self._prompt_seconds.value
            if self._prompt_seconds.value > 0
            else 0.0
        )
        self.current = StepCosts(
            prefill_rate=rate,
            decode_step_s=self._decode_seconds.value,
            decode_batch=self._decode_rows.value,
            decode_row_s=self._row_cost.slope,
            busy_seconds=self._busy,
            stall_s=self._stall,
        )


class BusyShare:
    """The share of wall time between two calls spent in steps (0 at the first call)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (busy seconds, wall time)

    def share(self, busy_seconds: float, now: float) -> float:
        last, self._last = self._last, (busy_seconds, now)
        if last is None or now <= last[1]:
            return 0.0
        return min(1.0, max(0.0, (busy_seconds - last[0]) / (now - last[1])))
