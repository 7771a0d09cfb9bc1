"""What `splitserve up` does to follow a PoolTarget, as pure functions: the live workers per
role from the scheduler's status, and the workers to start and to drain.

- `live_counts` counts a worker for the role it serves or is changing to (`next_role`);
  a draining one does not count, nor one of `ignored` (an id the launcher already drains,
  or an old incarnation of a restarted worker that the scheduler has not expired yet), and
  each of `pending` (started, not registered yet: a model loading) counts for its role.
- `reconcile` compares the counts with the target: it drains the extra workers of a role
  and starts the missing ones, within the bounds: at most `max_workers` (the draining ones
  not counted), and at least one worker always stays. A pinned mesh's new worker takes
  cores no running worker holds (`core_sizes`: as many as the plan's pool of its role had);
  an add that finds none is refused, with the reason.

The subtle rule: the counts are the scheduler's view corrected by what the launcher knows
and the scheduler cannot yet (a started worker is `pending` until it registers, a drained
one `ignored` until it beats as draining), so reconciling again on the next status, which
may be older than the last change, repeats no add and no drain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from services.launch_plan import PinnedPool
from shared.pool_messages import PoolTarget
from shared.protocol import ROLES, MeshStatus


@dataclass(frozen=True, slots=True)
class WorkerAdd:
    role: str
    cpus: tuple[int, ...]  # the cores it is pinned to; (): not pinned


@dataclass(frozen=True, slots=True)
class PoolChanges:
    adds: tuple[WorkerAdd, ...]  # workers to start, in order
    drains: tuple[str, ...]  # one role per worker to drain
    refused: tuple[str, ...]  # why a change the target asks for is not made

    def __bool__(self) -> bool:
        return bool(self.adds or self.drains)


def live_counts(
    status: MeshStatus, ignored: Collection[str] = (), pending: Iterable[str] = ()
) -> Counter[str]:
    """Workers per role: the registered ones that are not draining, by the role they serve
    next, plus one for each role of `pending`."""
    counts: Counter[str] = Counter(pending)
    for worker in status.workers:
        beat = worker.heartbeat
        if not beat.draining and beat.worker_id not in ignored:
            counts[beat.next_role or beat.role] += 1
    return counts


def core_sizes(pools: Sequence[PinnedPool]) -> dict[str, int]:
    """Cores per new worker of each role: its first pool's, else the smallest pool's; {}
    when the plan pins nothing."""
    if not pools:
        return {}
    smallest = min(len(pool.cpus) for pool in pools)
    own = {}
    for pool in reversed(pools):
        own[pool.role] = len(pool.cpus)
    return {role: own.get(role, smallest) for role in ROLES}


def free_cores(usable: Iterable[int], held: Collection[int]) -> list[int]:
    return sorted(core for core in usable if core not in held)


def reconcile(
    target: PoolTarget,
    live: Counter[str],
    max_workers: int,
    free: Sequence[int] = (),
    cores: dict[str, int] | None = None,
) -> PoolChanges:
    """The adds and drains that bring `live` to `target` within the bounds; `cores` is
    `core_sizes` of a pinned plan (None or {}: workers are not pinned), `free` its free
    cores, lowest first."""
    cores = cores or {}
    total = sum(live[role] for role in ROLES)
    drains = [role for role in ROLES for _ in range(live[role] - target.wanted(role))]
    refused = []
    if drains and total - len(drains) < 1:
        drains = drains[: total - 1]
        refused.append("at least one worker always stays")
    room = max_workers - (total - len(drains))
    spare = list(free)
    adds: list[WorkerAdd] = []
    for role in ROLES:
        for _ in range(target.wanted(role) - live[role]):
            if room <= 0:
                refused.append(f"{role}: at most {max_workers} workers (--max-workers)")
                break
            need = cores.get(role, 0)
            if len(spare) < need:
                refused.append(f"{role}: no {need} free core(s) for one more pinned worker")
                break
            adds.append(WorkerAdd(role, tuple(spare[:need])))
            spare = spare[need:]
            room -= 1
    return PoolChanges(tuple(adds), tuple(drains), tuple(refused))
