"""A planner inside the simulation: every interval, the mesh as `MeshSignals` to any object
with `decide(MeshSignals) -> list[Decision]` (the real `services.planner.policy.Planner`, or
a scripted one in tests), and its decisions applied to the modelled workers.

- SET_ROLE: the worker takes no new work, its dropped sides finish what they hold, then it
  switches (worker.py, as services/worker/role_change.py).
- ADD: a worker of the role starts after the cost model's `start_s` (its first heartbeat).
- DRAIN: the worker takes no new work, finishes what it holds, and stops beating; the
  registry expires it.
The percentiles of a snapshot are over the requests whose first token (TTFT) or last token
(TPOT) came within the last window (the service's `--planner-window`, 60 s by default).

The one subtle rule: a decision naming a worker that is gone, or a role that is no role, is
recorded and skipped (the actor, not the planner, finds out whether it took effect).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from loadtest.sim.mesh import SimMesh
from services.planner.decision import Action, Decision
from services.planner.signals import MeshSignals, WorkerSignal
from shared.protocol import ROLES


class Decider(Protocol):
    def decide(self, signals: MeshSignals) -> list[Decision]: ...


def mesh_signals(mesh: SimMesh, window_s: float) -> MeshSignals:
    now = mesh.loop.now
    workers = []
    for worker_id, worker in sorted(mesh.workers.items()):
        if worker_id in mesh.gone:
            continue
        costs, pool = worker.timer.current, worker.pool
        workers.append(
            WorkerSignal(
                worker_id,
                worker.role,
                next_role=worker.next_role,
                draining=worker.draining,
                num_running=len(worker.running),
                num_waiting=len(worker.waiting),
                queued_prompt_tokens=sum(
                    s.request.prompt_len - s.computed for s in [*worker.waiting, *worker.running]
                ),
                kv_usage=pool.held / pool.total,
                busy=worker.busy_share,
                prefill_rate=costs.prefill_rate,
                decode_step_s=costs.decode_step_s,
                decode_batch=costs.decode_batch,
                decode_row_s=costs.decode_row_s,
            )
        )
    since = now - window_s
    ttfts = [r.first_token - r.send for r in mesh.requests if r.first_token >= since]
    tpots = [t for when, r in mesh.ended if when >= since and (t := r.record().tpot) is not None]
    return MeshSignals(now, tuple(workers), _p99(ttfts), _p99(tpots), len(ttfts), len(tpots))


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else 0.0


def apply(mesh: SimMesh, decision: Decision) -> bool:
    """Act on one decision; False when it named a worker or role that is not there."""
    mesh.decisions.append((mesh.loop.now, decision))
    if decision.role not in ROLES and decision.action is not Action.DRAIN:
        return False
    if decision.action is Action.ADD:
        mesh.start_worker(decision.role, mesh.settings.new_worker_cores, mesh.cost.start_s)
        return True
    worker = mesh.workers.get(decision.worker_id)
    if worker is None or decision.worker_id in mesh.gone:
        return False
    if decision.action is Action.DRAIN:
        worker.draining = True
    elif decision.role != worker.role:
        worker.next_role = decision.role
    worker.kick()  # settles at once when it holds nothing it must finish
    return True


def plan_forever(mesh: SimMesh, decider: Decider, interval_s: float, window_s: float) -> None:
    """Ask `decider` every `interval_s` of simulated time, from one interval on, with the
    percentiles of the last `window_s`."""

    def tick() -> None:
        for decision in decider.decide(mesh_signals(mesh, window_s)):
            apply(mesh, decision)
        mesh.loop.after(interval_s, tick)

    mesh.loop.after(interval_s, tick)
