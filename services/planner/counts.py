"""How many workers serve each role, as the planner counts them, and what its decisions make
of those counts.

The subtle rule: a worker that drains counts for nothing (it is leaving), and one in the
middle of a role change counts for the role it is changing to, so that a change the planner
asked for is never asked for twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from services.planner.decision import Action, Decision
from services.planner.signals import MeshSignals, WorkerSignal


@dataclass(frozen=True, slots=True)
class RoleCounts:
    prefill: int = 0
    decode: int = 0
    both: int = 0

    def of(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode, "both": self.both}[role]

    def moved(self, role: str, change: int) -> RoleCounts:
        return replace(self, **{role: max(0, self.of(role) + change)})

    @property
    def decoders(self) -> int:
        """Workers that run streams (decode and both): a mesh needs one at least."""
        return self.decode + self.both

    @property
    def split(self) -> bool:
        """Does the mesh have prefill or decode pools (else it is aggregated, or empty)?"""
        return bool(self.prefill or self.decode)

    def __str__(self) -> str:
        return f"prefill={self.prefill} decode={self.decode} both={self.both}"


def serving_role(worker: WorkerSignal) -> str:
    """The role `worker` counts for: its next role while it changes."""
    return worker.next_role or worker.role


def staying(signals: MeshSignals) -> list[WorkerSignal]:
    """The workers that are not draining."""
    return [w for w in signals.workers if not w.draining]


def live_counts(signals: MeshSignals) -> RoleCounts:
    counts = RoleCounts()
    for worker in staying(signals):
        counts = counts.moved(serving_role(worker), +1)
    return counts


def counts_after(signals: MeshSignals, decisions: Iterable[Decision]) -> RoleCounts:
    """The counts once `decisions`, made on `signals`, have taken effect."""
    counts = live_counts(signals)
    roles = {w.worker_id: serving_role(w) for w in signals.workers}
    for decision in decisions:
        if decision.action is Action.ADD:
            counts = counts.moved(decision.role, +1)
        elif decision.action is Action.DRAIN:
            counts = counts.moved(decision.role, -1)
        else:
            counts = counts.moved(roles[decision.worker_id], -1).moved(decision.role, +1)
    return counts
