"""What the planner decides from: one snapshot of the mesh, built from the workers'
heartbeats by the planner service and from simulated workers by the simulator.

The subtle rule: a snapshot is all the planner sees. `Planner.decide` reads nothing else
(no clock, no NATS), so the same snapshots give the same decisions in the service, in the
simulator and in a unit test on recorded signals.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerSignal:
    """One worker as its latest heartbeat described it."""

    worker_id: str
    role: str  # the role it serves now: "prefill" | "decode" | "both"
    next_role: str = ""  # mid-change: the role it is changing to ("" when not changing)
    draining: bool = False
    num_running: int = 0
    num_waiting: int = 0
    queued_prompt_tokens: int = 0  # admitted, not computed yet
    kv_usage: float = 0.0  # share of its KV blocks in use, 0..1
    busy: float = 0.0  # share of the last interval spent in engine steps, 0..1
    prefill_rate: float = 0.0  # prompt tokens per second of step time (0: not measured)
    decode_step_s: float = 0.0  # seconds per decode-only step (0: not measured)
    decode_batch: float = 0.0  # the rows those steps had
    decode_row_s: float = 0.0  # seconds one more row adds to such a step (0: not fitted)


@dataclass(frozen=True, slots=True)
class MeshSignals:
    """The mesh at time `now` (seconds on the snapshot-maker's clock), with the latency
    percentiles of the requests that finished their first token (TTFT) or their stream
    (TPOT) within the planner's window; a percentile is 0.0 when it had no sample."""

    now: float
    workers: tuple[WorkerSignal, ...]
    ttft_p99: float = 0.0
    tpot_p99: float = 0.0
    ttft_samples: int = 0
    tpot_samples: int = 0
