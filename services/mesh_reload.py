"""`splitserve up --config FILE` read again while serving (SIGHUP to up, or the gateway's
POST /admin/reload, which sends it): a model swap without a gap.

`MeshReload.begin()` reads the file again and compares it with the mesh that runs. Refused,
with a logged message and nothing changed: a bad file, a model whose weights or engine
changed under the same name, a new model with no weights on disk, a reload while one is
under way. Otherwise `step()` carries it out, stage by stage:
  STARTING  the workers the new file adds start (ids `<model>-<role>-<i>`, as the plan
            names them); once every new model serves (the gateway's /ready?model=NAME),
            the gateway gets SIGHUP: it reads the file, and each changed route ramps from
            its old models to its new ones over `swap_ramp` seconds
            (services/gateway/reload.py). Past `ready_timeout`, or when a new worker cannot
            run, the reload is abandoned: its workers retired, the mesh as it was.
  RAMPING   after the ramp and RETIRE_MARGIN_S, the workers the file no longer has are
            retired: SIGTERM, they finish what they hold and exit (services/supervisor.py).
The subtle rule: a worker leaves only once no route can choose its model any more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import IntEnum

from services.launch_plan import LauncherConfig, WorkerPool, planned_workers, worker_template
from services.mesh_config import MeshConfig, MeshConfigError, load_mesh_config, model_dir_of
from services.supervisor import Child, ChildSpec, Supervisor

log = logging.getLogger(__name__)
RETIRE_MARGIN_S = 3.0  # after the ramp: requests routed at its last moment reach a worker
PROBE_EVERY_S = 0.5


class Stage(IntEnum):
    IDLE = 0
    STARTING = 1  # new workers starting; the gateway routes as before
    RAMPING = 2  # the gateway reloaded; old workers leave when the ramp ends


class ReloadRefused(ValueError):
    """The new mesh config cannot replace the running one; nothing changed."""


@dataclass(slots=True)
class Swap:
    mesh: MeshConfig  # the file as read
    waiting: tuple[str, ...]  # the new models, until each serves
    started: list[Child]  # the workers it added
    leaving: list[Child]  # the workers it removes, once the ramp ends
    deadline: float  # STARTING: abandoned past it; RAMPING: when the old workers leave
    stage: Stage = Stage.STARTING
    next_probe: float = 0.0


@dataclass(slots=True)
class MeshReload:
    config: LauncherConfig  # its mesh: the one running
    supervisor: Supervisor
    nats_url: str
    ports: Iterator[int]  # metrics ports for new workers
    credentialed: Callable[[ChildSpec], ChildSpec]
    model_ready: Callable[[str], bool]  # the gateway's /ready?model=NAME answers 200
    swap: Swap | None = field(default=None)

    def begin(self, now: float) -> None:
        """Read the file again and start the swap, or log why not."""
        try:
            self.swap = self._plan(now)
        except (ReloadRefused, MeshConfigError) as exc:
            log.error("reload refused, the mesh serves as before: %s", exc)

    def _plan(self, now: float) -> Swap:
        if self.swap is not None:
            raise ReloadRefused(f"a reload is under way ({self.swap.stage.name.lower()})")
        assert self.config.mesh is not None and self.config.mesh_file is not None
        mesh = load_mesh_config(self.config.mesh.source)
        old = {m.name: m for m in self.config.mesh.mesh_models}
        for model in mesh.mesh_models:
            was = old.get(model.name)
            if was is not None and (was.model, was.model_dir, was.engine_argv) != (
                model.model, model.model_dir, model.engine_argv
            ):  # fmt: skip
                raise ReloadRefused(
                    f"model {model.name!r}: its weights or engine changed; give the new one "
                    "another name and move a route to it"
                )
            directory = model_dir_of(model, self.config.home)
            if was is None and not (directory / "config.json").is_file():
                raise ReloadRefused(
                    f"model {model.name!r}: no weights in {directory} (splitserve pull first)"
                )
        planned = planned_workers(replace(self.config, mesh=mesh))
        running = {
            c.spec.worker_id: c
            for c in self.supervisor.children
            if c.spec.role == "worker" and not c.retiring
        }
        ids = {worker_id for _, worker_id in planned}
        started = [self._start(pool, wid) for pool, wid in planned if wid not in running]
        leaving = [child for wid, child in running.items() if wid not in ids]
        waiting = tuple(m.name for m in mesh.mesh_models if m.name not in old)
        log.info(
            "reloading %s: new models %s; %d workers start, %d leave after the ramp",
            mesh.source, ", ".join(waiting) or "none", len(started), len(leaving),
        )  # fmt: skip
        return Swap(mesh, waiting, started, leaving, now + self.config.ready_timeout)

    def _start(self, pool: WorkerPool, worker_id: str) -> Child:
        template = worker_template(self.config, self.nats_url).for_pool(pool)
        spec = template.spec(pool.role, worker_id, pool.cpus, next(self.ports))
        return self.supervisor.add(self.credentialed(spec))

    def step(self, now: float) -> None:
        swap = self.swap
        if swap is None:
            return
        if swap.stage is Stage.STARTING:
            self._starting(swap, now)
        elif now >= swap.deadline:
            for child in swap.leaving:
                self.supervisor.retire(child)
            self.config = replace(self.config, mesh=swap.mesh)
            self.swap = None
            log.info("reload of %s done: %d workers retired", swap.mesh.source, len(swap.leaving))

    def _starting(self, swap: Swap, now: float) -> None:
        failed = [c.spec.name for c in swap.started if c.gave_up]
        if failed or now >= swap.deadline:
            why = f"{', '.join(failed)} cannot run" if failed else "not serving in time"
            log.error("reload abandoned (%s: see its log above); the mesh serves as before", why)
            for child in swap.started:
                self.supervisor.retire(child)
            self.swap = None
            return
        if now < swap.next_probe:
            return
        swap.next_probe = now + PROBE_EVERY_S
        swap.waiting = tuple(m for m in swap.waiting if not self.model_ready(m))
        if swap.waiting:
            return
        self.supervisor.hangup("gateway")
        swap.stage = Stage.RAMPING
        swap.deadline = now + self.config.swap_ramp + RETIRE_MARGIN_S
