"""Hand-made planner snapshots for the planner's tests (recorded signal sequences)."""

from __future__ import annotations

from typing import Any

from services.planner.config import PlannerConfig
from services.planner.decision import Decision
from services.planner.policy import Planner
from services.planner.signals import MeshSignals, WorkerSignal

# Objectives 1 s / 40 ms; a need acts on its 2nd snapshot in a row; 30 s between decisions.
CONFIG = PlannerConfig(hold=2, cooldown=30.0, settle=120.0, min_samples=5, max_per_role=3)


def worker(worker_id: str, role: str, **fields: Any) -> WorkerSignal:
    defaults: dict[str, Any] = {"busy": 0.5, "num_running": 2, "prefill_rate": 1000.0}
    return WorkerSignal(worker_id, role, **(defaults | fields))


def snap(
    now: float,
    workers: list[WorkerSignal],
    ttft: float = 0.3,
    tpot: float = 0.02,
    samples: int = 20,
) -> MeshSignals:
    """A snapshot with `samples` of each latency (p99s `ttft`, `tpot`): by default both
    objectives met with margin and every worker half busy."""
    return MeshSignals(now, tuple(workers), ttft, tpot, samples, samples)


def run(planner: Planner, series: list[MeshSignals]) -> list[list[Decision]]:
    """The decisions of each snapshot, in order."""
    return [planner.decide(signals) for signals in series]


def every(period: float, count: int, start: float = 0.0) -> list[float]:
    return [start + i * period for i in range(count)]
