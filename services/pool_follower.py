"""`splitserve up` following a PoolTarget: workers started and drained while serving.

Stepped by the launcher's main loop (services/launcher.py), never blocking it: once a
target has been heard (services/pool_link.py), every `interval` seconds it asks the
scheduler's status, and when the answer comes it counts the live workers per role
(services/pool_reconcile.py: live_counts), reconciles, and applies: a new worker is a child
made from the plan's WorkerTemplate (same model and flags, a fresh `--worker-id`, the role
wanted, free cores when pinned); a drained one is one of the launcher's own workers of that
role (one still loading first, then the one holding the fewest requests), sent SIGTERM: it
finishes what it holds and exits, and the supervisor retires it. Every add and drain is
logged with the target's publisher, seq_no and reason; a change the bounds refuse is logged
once per target. One model is served (`up` follows no target with a mesh config), so a
target's `model` is not compared.

The subtle rule: an id the launcher drained, or an earlier incarnation of a restarted
worker, is never counted again, even while the scheduler still lists it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable, Iterable, Iterator

from services.launch_plan import WorkerTemplate
from services.pool_link import PoolLink
from services.pool_reconcile import WorkerAdd, core_sizes, free_cores, live_counts, reconcile
from services.supervisor import Child, ChildSpec, Supervisor
from shared.pool_messages import PoolTarget
from shared.protocol import MeshStatus, WorkerStatus

log = logging.getLogger(__name__)
FOLLOW_INTERVAL_S = 1.0  # between two looks at the status while a target is followed


def usable_cores() -> set[int]:
    return os.sched_getaffinity(0)


class PoolFollower:
    def __init__(
        self,
        link: PoolLink,
        template: WorkerTemplate,
        supervisor: Supervisor,
        metrics_ports: Iterator[int],
        max_workers: int,
        credentials: Callable[[ChildSpec], ChildSpec] = lambda spec: spec,
        interval: float = FOLLOW_INTERVAL_S,
    ) -> None:
        self.link, self.template, self.supervisor = link, template, supervisor
        self.metrics_ports, self.max_workers = metrics_ports, max_workers
        self.credentials, self.interval = credentials, interval
        self.cores = core_sizes(template.pools)
        self._asked: concurrent.futures.Future[MeshStatus] | None = None
        self._next_ask = 0.0
        self._gone: set[str] = set()  # worker ids drained: never counted again
        self._said: set[tuple[str, int, str]] = set()  # (publisher, seq_no, what) logged

    def step(self, now: float) -> None:
        """Collect a status that arrived and follow the target; or ask for one when due."""
        if self._asked is None:
            if now >= self._next_ask and self.link.connected and self.link.target() is not None:
                self._next_ask = now + self.interval
                self._asked = self.link.ask_status()
            return
        if not self._asked.done():
            return
        asked, self._asked = self._asked, None
        try:
            status = asked.result()
        except Exception as exc:  # no scheduler yet, a deadline: asked again next time
            log.debug("pool follower: no status (%s)", exc or type(exc).__name__)
            return
        if (target := self.link.target()) is not None:
            self.follow(target, status)

    def follow(self, target: PoolTarget, status: MeshStatus) -> None:
        workers = [c for c in self.supervisor.children if c.spec.worker_role]
        for child in workers:
            ids = child.worker_ids()
            self._gone.update(ids if child.retiring or child.gave_up else ids[:-1])
        own = [c for c in workers if not (c.retiring or c.gave_up)]
        registered = {w.heartbeat.worker_id: w for w in status.workers}
        pending = [c.spec.worker_role for c in own if _current_id(c) not in registered]
        live = live_counts(status, self._gone, pending)
        free = free_cores(usable_cores(), self.supervisor.held_cores()) if self.cores else []
        changes = reconcile(target, live, self.max_workers, free, self.cores)
        for why in changes.refused:
            self._say_once(target, f"pool target {_name(target)}: not followed in full: {why}")
        for add in changes.adds:
            self._add(target, add, registered.keys())
        for role in changes.drains:
            candidates = [c for c in own if _role(c, registered) == role]
            if not candidates:
                self._say_once(target, f"pool target {_name(target)}: no {role} worker of "
                               "this launcher's to drain")  # fmt: skip
                continue
            child = min(candidates, key=lambda c: _drain_cost(c, registered, own))
            own.remove(child)
            self._gone.add(_current_id(child))
            log.info("draining worker %s (%s) for %s", _current_id(child), role, _why(target))
            self.supervisor.retire(child)

    def _add(self, target: PoolTarget, add: WorkerAdd, registered: Iterable[str]) -> None:
        """Start a worker of `add.role` with an id no worker had (ours, or registered)."""
        taken = self._gone | {i for c in self.supervisor.children for i in c.worker_ids()}
        taken.update(registered)
        name = self.template.prefix + add.role
        worker_id = next(f"{name}-{n}" for n in range(len(taken) + 1) if f"{name}-{n}" not in taken)
        port = next(self.metrics_ports)
        spec = self.template.spec(add.role, worker_id, add.cpus, port)
        pinned = f" on cores {','.join(map(str, add.cpus))}" if add.cpus else ""
        log.info("adding worker %s (%s)%s for %s", worker_id, add.role, pinned, _why(target))
        try:
            self.supervisor.add(self.credentials(spec))
        except OSError as exc:  # tried again at the next look, as the counts still ask
            log.error("could not start worker %s: %s", worker_id, exc)

    def _say_once(self, target: PoolTarget, what: str) -> None:
        key = (target.publisher, target.seq_no, what)
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", what)


def _current_id(child: Child) -> str:
    return child.worker_ids()[-1]


def _role(child: Child, registered: dict[str, WorkerStatus]) -> str:
    """The role a worker serves next by its status; its initial one while not registered."""
    if (worker := registered.get(_current_id(child))) is None:
        return child.spec.worker_role
    return worker.heartbeat.next_role or worker.heartbeat.role


def _drain_cost(
    child: Child, registered: dict[str, WorkerStatus], own: list[Child]
) -> tuple[bool, int, int]:
    """Loading ones first (they hold nothing), then the fewest requests, then the newest."""
    worker = registered.get(_current_id(child))
    held = worker.heartbeat.num_requests if worker is not None else 0
    return worker is not None, held, -own.index(child)


def _name(target: PoolTarget) -> str:
    return f"{target.publisher} #{target.seq_no}"


def _why(target: PoolTarget) -> str:
    wanted = f"prefill {target.prefill}, decode {target.decode}, both {target.both}"
    return f"pool target {_name(target)} ({wanted}): {target.reason or 'no reason given'}"
