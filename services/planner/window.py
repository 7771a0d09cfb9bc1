"""The planner's view of the mesh: heartbeats in, a `MeshSignals` snapshot out.

Each worker's latest heartbeat gives its `WorkerSignal` (KV usage = blocks in use / total);
the TTFTs (`Heartbeat.first_tokens`) and TPOTs (`Heartbeat.stream_tpots`) the heartbeats
carry are kept with their arrival time, and a snapshot takes the p99 of those that arrived
within the last `window_s` seconds (nearest rank: the smallest sample at or above 99% of
them). The subtle rule: a worker silent for `stale_s` is left out of the snapshot (the
scheduler counts it lost by then), and its samples stay: users saw those latencies.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from services.planner.signals import MeshSignals, WorkerSignal
from shared.protocol import Heartbeat

MAX_SAMPLES = 100_000  # of each kind kept; beyond, the oldest go first


def worker_signal(beat: Heartbeat) -> WorkerSignal:
    used = beat.total_blocks - beat.free_blocks
    return WorkerSignal(
        worker_id=beat.worker_id,
        role=beat.role,
        next_role=beat.next_role,
        draining=beat.draining,
        num_running=beat.num_running,
        num_waiting=beat.num_waiting,
        queued_prompt_tokens=beat.queued_prompt_tokens,
        kv_usage=used / beat.total_blocks if beat.total_blocks else 0.0,
        busy=beat.busy,
        prefill_rate=beat.prefill_rate,
        decode_step_s=beat.decode_step_s,
        decode_batch=beat.decode_batch,
        decode_row_s=beat.decode_row_s,
    )


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


@dataclass(slots=True)
class _Seen:
    signal: WorkerSignal
    at: float


class SignalWindow:
    def __init__(self, window_s: float, stale_s: float, model: str = "") -> None:
        self.window_s = window_s
        self.stale_s = stale_s
        self.model = model  # only this model's workers ("": every worker)
        self._workers: dict[str, _Seen] = {}
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (arrival, s)
        self._tpots: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def add(self, beat: Heartbeat, now: float) -> None:
        if self.model and beat.model != self.model:
            return
        self._workers[beat.worker_id] = _Seen(worker_signal(beat), now)
        self._ttfts.extend((now, first.ttft) for first in beat.first_tokens)
        self._tpots.extend((now, tpot) for tpot in beat.stream_tpots)

    def snapshot(self, now: float) -> MeshSignals:
        horizon = now - self.window_s
        for samples in (self._ttfts, self._tpots):
            while samples and samples[0][0] < horizon:
                samples.popleft()
        self._workers = {k: v for k, v in self._workers.items() if now - v.at <= self.stale_s}
        ttfts = [value for _, value in self._ttfts]
        tpots = [value for _, value in self._tpots]
        workers = tuple(seen.signal for _, seen in sorted(self._workers.items()))
        return MeshSignals(now, workers, p99(ttfts), p99(tpots), len(ttfts), len(tpots))
