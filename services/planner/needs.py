"""What one snapshot says the mesh needs, before any mode turns it into actions.

  MORE_PREFILL  TTFT p99 over its objective (TTFT_OVER_SLO), or the prompt tokens queued on
                the prefill side would take longer than margin x the TTFT objective to
                compute at the rate it measured (PREFILL_QUEUE)
  MORE_DECODE   TPOT p99 over its objective (TPOT_OVER_SLO), or the decoding workers' KV
                usage at `kv_high` or more on average (KV_FULL)
  LESS_PREFILL  both objectives met with margin (p99 <= margin x SLO, each with
                `min_samples`), no MORE_* need, and the prefill workers idle: mean busy
                share under `busy_low` (PREFILL_IDLE)
  LESS_DECODE   the same for the decoding workers (decode and both), whose KV must also be
                under `kv_high` (DECODE_IDLE)

The subtle rule: a percentile counts only with `min_samples` behind it, and scaling down
needs both objectives measured and met; a need to add capacity needs only its own signal.
The prefill side is the prefill workers, or the both workers in a mesh without any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from services.planner.config import PlannerConfig
from services.planner.counts import serving_role, staying
from services.planner.decision import Reason
from services.planner.signals import MeshSignals, WorkerSignal


class NeedKind(IntEnum):
    MORE_PREFILL = 1
    MORE_DECODE = 2
    LESS_PREFILL = 3
    LESS_DECODE = 4


@dataclass(frozen=True, slots=True)
class Need:
    kind: NeedKind
    reason: Reason
    pressure: float  # how far past its threshold (1.0: at it); ranks two needs that conflict
    detail: str  # the figures behind it
    moves: int = 0  # roles mode, from demand (demand.py): workers to move; 0: the mode decides


@dataclass(frozen=True, slots=True)
class Side:
    """The workers of one side of the split and their figures."""

    workers: tuple[WorkerSignal, ...]

    @property
    def busy(self) -> float:
        return _mean([w.busy for w in self.workers])

    @property
    def kv_usage(self) -> float:
        return _mean([w.kv_usage for w in self.workers])

    @property
    def queue_s(self) -> float:
        """Seconds the queued prompt tokens take at the measured rate (0: none measured)."""
        rate = sum(w.prefill_rate for w in self.workers)
        return sum(w.queued_prompt_tokens for w in self.workers) / rate if rate > 0 else 0.0


def side(signals: MeshSignals, roles: tuple[str, ...]) -> Side:
    """The staying workers (mid-change ones by their next role) serving one of `roles`."""
    return Side(tuple(w for w in staying(signals) if serving_role(w) in roles))


def prefill_side(signals: MeshSignals) -> Side:
    found = side(signals, ("prefill",))
    return found if found.workers else side(signals, ("both",))


def decode_side(signals: MeshSignals) -> Side:
    return side(signals, ("decode", "both"))


def needs(signals: MeshSignals, config: PlannerConfig) -> list[Need]:
    """Every need `signals` shows (at most one of each kind), by the rules above."""
    c, s = config, signals
    found: list[Need] = []
    ttft = _measured(s.ttft_p99, s.ttft_samples, c)
    tpot = _measured(s.tpot_p99, s.tpot_samples, c)
    queue_s = prefill_side(s).queue_s
    if ttft is not None and ttft > c.ttft_slo:
        detail = f"TTFT p99 {ttft:.3f} s > {c.ttft_slo:.3f} s ({s.ttft_samples} samples)"
        found.append(Need(NeedKind.MORE_PREFILL, Reason.TTFT_OVER_SLO, ttft / c.ttft_slo, detail))
    elif queue_s > c.margin * c.ttft_slo:
        limit = c.margin * c.ttft_slo
        detail = f"prefill queue {queue_s:.2f} s of prompt tokens > {limit:.2f} s"
        found.append(Need(NeedKind.MORE_PREFILL, Reason.PREFILL_QUEUE, queue_s / limit, detail))
    decoding = decode_side(s)
    if tpot is not None and tpot > c.tpot_slo:
        ms, slo_ms = tpot * 1e3, c.tpot_slo * 1e3
        detail = f"TPOT p99 {ms:.1f} ms > {slo_ms:.1f} ms ({s.tpot_samples} samples)"
        found.append(Need(NeedKind.MORE_DECODE, Reason.TPOT_OVER_SLO, tpot / c.tpot_slo, detail))
    elif decoding.workers and decoding.kv_usage >= c.kv_high:
        usage = decoding.kv_usage
        detail = f"decode KV {usage:.0%} used >= {c.kv_high:.0%}"
        found.append(Need(NeedKind.MORE_DECODE, Reason.KV_FULL, usage / c.kv_high, detail))
    if found or ttft is None or tpot is None:
        return found
    if ttft > c.margin * c.ttft_slo or tpot > c.margin * c.tpot_slo:
        return found
    met = f"TTFT p99 {ttft:.3f} s, TPOT p99 {tpot * 1e3:.1f} ms within {c.margin:.0%} of the SLO"
    prefilling = side(s, ("prefill",))
    if prefilling.workers and prefilling.busy < c.busy_low:
        detail = f"prefill busy {prefilling.busy:.0%} < {c.busy_low:.0%}; {met}"
        found.append(Need(NeedKind.LESS_PREFILL, Reason.PREFILL_IDLE, 1.0, detail))
    if decoding.workers and decoding.busy < c.busy_low and decoding.kv_usage < c.kv_high:
        detail = f"decode busy {decoding.busy:.0%} < {c.busy_low:.0%}; {met}"
        found.append(Need(NeedKind.LESS_DECODE, Reason.DECODE_IDLE, 1.0, detail))
    return found


def _measured(p99: float, samples: int, config: PlannerConfig) -> float | None:
    return p99 if samples >= config.min_samples else None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
