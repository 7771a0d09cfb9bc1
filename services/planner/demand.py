"""Needs from the load in flight (`--planner-signals demand`), not from windowed p99s: how
many workers' worth of prefill and of decode the mesh holds now, and the split of its
workers that serves both best.

  prefill need = Σ busy share of the prefill side + the prompt tokens queued on any worker
                 / (the measured prefill rate per worker × margin × TTFT objective)
  decode need  = streams on the decoding workers / the streams one worker holds within
                 margin × TPOT objective; a worker's step is `fixed + rows × row cost`,
                 the row cost fitted by the worker (Heartbeat.decode_row_s), or, until it
                 is, the step over its rows (as if it had no fixed part: more decode need)
  pressure     = need / workers on each side; the mesh's is the larger of the two

In roles mode the best split of the prefill and decode workers is the one of least pressure
(services/planner/modes.py moves workers toward it); a need shows when the mesh's pressure
is at least `margin` and the best split's is at most GAIN × it. In replicas mode a side whose
pressure passes 1 wants one more worker.

The subtle rule: this reads one snapshot, so it answers a change of mix within a few
heartbeats, where p99s over a window answer after the window; it needs measured rates (a
side none of whose workers has measured one gives no need), and it is only for meshes split
into prefill and decode workers (a mesh with both workers is left to the latency rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.planner.config import PlannerConfig
from services.planner.decision import Reason
from services.planner.needs import Need, NeedKind, side
from services.planner.signals import MeshSignals, WorkerSignal

GAIN = 0.75  # a move must bring the mesh's pressure to at most this share of today's
RESERVE = 0.25  # each side keeps at least this share of the workers (the next phase needs them)


@dataclass(frozen=True, slots=True)
class Demand:
    prefill: float  # workers' worth of prefill work in flight
    decode: float  # workers' worth of streams
    prefill_workers: int
    decode_workers: int

    def pressure(self, prefill_workers: int) -> float:
        """The mesh's pressure with its workers split `prefill_workers` : the rest."""
        decode_workers = self.prefill_workers + self.decode_workers - prefill_workers
        if prefill_workers < 1 or decode_workers < 1:
            return float("inf")
        return max(self.prefill / prefill_workers, self.decode / decode_workers)

    def best_prefill_workers(self) -> int:
        """The split of least pressure; of equals, the one nearest today's."""
        total, now = self.prefill_workers + self.decode_workers, self.prefill_workers
        least = max(1, math.ceil(RESERVE * total))
        splits = range(least, total - least + 1) if 2 * least <= total else range(1, total)
        return min(splits, key=lambda p: (self.pressure(p), abs(p - now)))

    def __str__(self) -> str:
        return (
            f"prefill need {self.prefill:.2f} on {self.prefill_workers}, "
            f"decode need {self.decode:.2f} on {self.decode_workers}"
        )


def mesh_demand(signals: MeshSignals, config: PlannerConfig) -> Demand | None:
    """The mesh's demand, or None where it is not split or has measured no rate."""
    prefill, decode = side(signals, ("prefill",)).workers, side(signals, ("decode",)).workers
    if not prefill or not decode or side(signals, ("both",)).workers:
        return None
    rates = [w.prefill_rate for w in signals.workers if w.prefill_rate > 0]
    capacities = [c for w in decode if (c := streams_within(w, config)) > 0]
    if not rates or not capacities:
        return None
    rate = sum(rates) / len(rates)
    queued = sum(w.queued_prompt_tokens for w in signals.workers if not w.draining)
    prefill_need = sum(w.busy for w in prefill) + queued / (rate * config.margin * config.ttft_slo)
    streams = sum(w.num_running + w.num_waiting for w in decode)
    decode_need = streams / (sum(capacities) / len(capacities))
    return Demand(prefill_need, decode_need, len(prefill), len(decode))


def streams_within(worker: WorkerSignal, config: PlannerConfig) -> float:
    """Streams `worker` decodes within margin x the TPOT objective (0: not measured)."""
    step, rows = worker.decode_step_s, max(1.0, worker.decode_batch)
    if step <= 0:
        return 0.0
    row_s = worker.decode_row_s if worker.decode_row_s > 0 else step / rows
    fixed = max(0.0, step - row_s * rows)
    return max(1.0, (config.margin * config.tpot_slo - fixed) / row_s)


def demand_needs(signals: MeshSignals, config: PlannerConfig) -> list[Need] | None:
    """The needs the demand shows (None: no demand to read; the latency rules apply)."""
    demand = mesh_demand(signals, config)
    if demand is None:
        return None
    now_p = demand.prefill_workers
    if config.mode != "roles":
        found = []
        if demand.prefill / now_p > 1:
            found.append(_need(NeedKind.MORE_PREFILL, demand, demand.prefill / now_p, 0))
        if demand.decode / demand.decode_workers > 1:
            pressure = demand.decode / demand.decode_workers
            found.append(_need(NeedKind.MORE_DECODE, demand, pressure, 0))
        return found
    pressure, best = demand.pressure(now_p), demand.best_prefill_workers()
    if best == now_p or pressure < config.margin or demand.pressure(best) > GAIN * pressure:
        return []
    kind = NeedKind.MORE_PREFILL if best > now_p else NeedKind.MORE_DECODE
    return [_need(kind, demand, pressure / demand.pressure(best), abs(best - now_p))]


def _need(kind: NeedKind, demand: Demand, pressure: float, moves: int) -> Need:
    reason = Reason.PREFILL_DEMAND if kind is NeedKind.MORE_PREFILL else Reason.DECODE_DEMAND
    best = demand.best_prefill_workers()
    detail = f"{demand}: best split {best} prefill (pressure {demand.pressure(best):.2f})"
    return Need(kind, reason, pressure, detail, moves)
