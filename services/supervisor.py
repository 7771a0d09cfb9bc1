"""The children of `splitserve up` and their supervision: each service a process in its own
session; one that exits is restarted after a backoff that doubles with each recent restart,
up to `max_restarts_per_minute`, then given up on (`lost_essentials` names those the mesh
cannot serve without); shutdown goes group by group (a role outside STOP_ORDER first, then
gateway, workers, scheduler), SIGTERM, `grace` seconds, then SIGUSR1 for a hung child's
thread stacks, then SIGKILL; what a child leaves in its session is killed with it.

While serving, children come and go (services/pool_follower.py): `add` starts one more,
`retire` sends a worker SIGTERM, on which it drains (finishes what it holds) and exits.
A child that exits with services/cannot_run.py's status (its configuration cannot run:
a restart would fail the same way) is not restarted; `cannot_run` names it with the message
it left, and `up` stops with that message.

Every child finds the launcher's pid in UP_PID_ENV (the gateway's POST /admin/reload
signals it); `hangup` sends the children of a role SIGHUP (the gateway reads its mesh
config again: services/mesh_reload.py). With `standby`, a worker started after the plan's
(added, restarted) is a standby process handed its command line (services/standby.py); the
first standby starts once the launcher says the plan's children serve (`serving`), so that
it does not compete with their start for the cores.

The subtle rule: a retired child that exits is removed, never restarted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from services.cannot_run import CANNOT_RUN, MESSAGE_FILE_ENV, left_message
from services.standby import StandbyWorker
from shared.service_loop import STACK_DUMP_SIGNAL

log = logging.getLogger(__name__)

STOP_ORDER = ("planner", "gateway", "worker", "scheduler")  # then nats-server
# Every request passes these: a mesh that gave up on one serves nobody.
ESSENTIAL_ROLES = ("gateway", "scheduler")
MAX_BACKOFF_S = 30.0
STACK_DUMP_WAIT_S = 2.0  # for a hung child to print its stacks before SIGKILL
UP_PID_ENV = "SPLITSERVE_UP_PID"  # set for every child: the launcher's pid


class MeshDown(RuntimeError):
    """The supervisor gave up on a child of an essential role."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str  # unique, shown in logs
    role: str  # "scheduler" | "worker" | "gateway": decides the shutdown order
    argv: tuple[str, ...]
    metrics_port: int | None = None  # its --metrics-port, listed at start; None: not given
    worker_role: str = ""  # a worker's --role (its initial one); "" for other services
    worker_id: str = ""  # a worker's --worker-id (its first incarnation's)
    cpus: tuple[int, ...] = ()  # a pinned worker's cores


class Child:
    def __init__(self, spec: ChildSpec, message_file: Path) -> None:
        self.spec = spec
        self.message_file = message_file  # where it leaves why it cannot run, if it cannot
        self.cannot_run = ""  # its message, once it exited with CANNOT_RUN
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts: deque[float] = deque()  # monotonic times of recent restarts
        self.restart_at: float | None = None  # when a crashed child is due to start again
        self.gave_up = False
        self.retiring = False  # sent SIGTERM to drain: removed once it exits
        self.incarnation = 0  # starts so far

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, standby: StandbyWorker | None = None) -> None:
        """Start it: as `standby` (a worker's imports done already) when one waits."""
        environment = child_environment() | {MESSAGE_FILE_ENV: str(self.message_file)}
        argv = self.argv()
        taken = standby.take(argv, environment) if standby is not None else None
        self.process = taken or subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, start_new_session=True, env=environment
        )
        self.incarnation += 1
        self.restart_at = None
        how = " from the standby" if taken else ""
        log.info(
            "started %s (role %s) pid %d%s", self.spec.name, self.spec.role, self.process.pid, how
        )

    def argv(self) -> tuple[str, ...]:
        """The spec's command; a restarted worker's id gets the suffix `-r<incarnation>`."""
        argv = self.spec.argv
        if not self.incarnation or "--worker-id" not in argv:
            return argv
        at = argv.index("--worker-id") + 1
        return (*argv[:at], f"{argv[at]}-r{self.incarnation}", *argv[at + 1 :])

    def worker_ids(self) -> list[str]:
        """A worker's ids, one per start so far, the current (last) one last."""
        first = self.spec.worker_id
        return [first] + [f"{first}-r{n}" for n in range(1, self.incarnation)] if first else []


class Supervisor:
    def __init__(
        self,
        specs: list[ChildSpec],
        restart_backoff: float,
        max_restarts_per_minute: int,
        grace: float,
        standby: bool = False,
    ) -> None:
        self._messages = tempfile.TemporaryDirectory(prefix="splitserve-children-")
        self.children = [self._child(spec) for spec in specs]
        self.restart_backoff = restart_backoff
        self.max_restarts_per_minute = max_restarts_per_minute
        self.grace = grace
        # a worker's imports done before it is needed (services/standby.py)
        self.standby = StandbyWorker(child_environment()) if standby else None
        self._standby_due = False  # set by `serving`

    def _child(self, spec: ChildSpec) -> Child:
        return Child(spec, Path(self._messages.name) / f"{spec.name}.cannot-run")

    def start_all(self) -> None:
        for child in self.children:
            child.start()

    def serving(self) -> None:
        """The plan's children serve (or the wait for that is over): the standby may start."""
        self._standby_due = True

    def _start(self, child: Child) -> None:
        child.start(self.standby if child.spec.role == "worker" else None)

    def add(self, spec: ChildSpec) -> Child:
        """Start one more child, supervised like the others."""
        if any(c.spec.name == spec.name for c in self.children):
            raise ValueError(f"a child named {spec.name!r} is already supervised")
        child = self._child(spec)
        self._start(child)  # OSError: nothing is added
        self.children.append(child)
        return child

    def retire(self, child: Child) -> None:
        """SIGTERM: the worker drains and exits; then it is removed, not restarted."""
        child.retiring = True
        if child.running:
            log.info("draining %s (pid %d)", child.spec.name, child.process.pid)
            child.process.terminate()

    def hangup(self, role: str) -> None:
        """SIGHUP to each running child of `role`."""
        for child in self.children:
            if child.spec.role == role and child.running:
                log.info("SIGHUP to %s (pid %d)", child.spec.name, child.process.pid)
                child.process.send_signal(signal.SIGHUP)

    def held_cores(self) -> set[int]:
        """The cores of every child that runs or will start again (a retiring one holds
        its cores until it exits)."""
        holding = [c for c in self.children if c.running or not (c.gave_up or c.retiring)]
        return {core for child in holding for core in child.spec.cpus}

    def poll(self) -> None:
        """Notice crashed children and restart those that are due; remove retired ones."""
        now = time.monotonic()
        if self.standby is not None and self._standby_due:
            self.standby.spawn()  # none waits: the last was handed off, or it died
        for child in list(self.children):
            if child.retiring and not child.running:
                code = child.process.returncode if child.process else None
                log.info("%s drained and exited with %s: retired", child.spec.name, code)
                _kill_session(child)
                self.children.remove(child)
                continue
            if child.gave_up or child.running:
                continue
            if child.restart_at is None:
                self._schedule_restart(child, now)
            elif now >= child.restart_at:
                child.restarts.append(now)
                self._start(child)

    def _schedule_restart(self, child: Child, now: float) -> None:
        code = child.process.returncode if child.process else None
        _kill_session(child)
        if code == CANNOT_RUN:
            child.gave_up = True
            child.cannot_run = left_message(child.message_file)
            log.error("%s cannot run its configuration: not restarted", child.spec.name)
            return
        while child.restarts and now - child.restarts[0] > 60:
            child.restarts.popleft()
        if len(child.restarts) >= self.max_restarts_per_minute:
            child.gave_up = True
            log.error(
                "%s exited with %s and was restarted %d times within a minute: giving up on it",
                child.spec.name,
                code,
                len(child.restarts),
            )
            return
        delay = min(MAX_BACKOFF_S, self.restart_backoff * 2 ** len(child.restarts))
        child.restart_at = now + delay
        log.warning("%s exited with %s; restarting in %.1fs", child.spec.name, code, delay)

    def lost_essentials(self) -> list[str]:
        """The children of an essential role given up on."""
        return [c.spec.name for c in self.children if c.gave_up and c.spec.role in ESSENTIAL_ROLES]

    def cannot_run(self) -> list[tuple[str, str]]:
        """(name, message) of each child that exited saying it cannot run its configuration
        (but one retired: a reload's worker that could not run is the reload's failure)."""
        return [
            (c.spec.name, c.cannot_run) for c in self.children if c.cannot_run and not c.retiring
        ]

    def missing(self) -> list[str]:
        return [child.spec.name for child in self.children if not child.running]

    def stop_all(self) -> None:
        if self.standby is not None:
            self.standby.close()
        others = [c for c in self.children if c.spec.role not in STOP_ORDER and c.running]
        self._stop_group(others)
        for role in STOP_ORDER:
            self._stop_group([c for c in self.children if c.spec.role == role and c.running])
        self._messages.cleanup()

    def _stop_group(self, group: list[Child]) -> None:
        for child in group:
            log.info("stopping %s (pid %d)", child.spec.name, child.process.pid)
            child.process.terminate()
        deadline = time.monotonic() + self.grace
        for child in group:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s ignored SIGTERM for %.0fs: its threads' stacks follow; killing it",
                    child.spec.name,
                    self.grace,
                )
                _dump_stacks(child)
                child.process.kill()
                child.process.wait()
            _kill_session(child)


def child_environment() -> dict[str, str]:
    """Every child's environment (a child adds its own cannot-run file)."""
    return dict(os.environ) | {"PYTHONUNBUFFERED": "1", UP_PID_ENV: str(os.getpid())}


def _dump_stacks(child: Child) -> None:
    """Have a hung child print its threads' stacks into the log (service_loop.run sets
    SIGUSR1 to do that), and give it a moment to write them."""
    with contextlib.suppress(ProcessLookupError):
        child.process.send_signal(STACK_DUMP_SIGNAL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.process.wait(STACK_DUMP_WAIT_S)


def _kill_session(child: Child) -> None:
    """Kill what an exited child left in its session: a vLLM worker's engine processes spin
    on a core each until killed."""
    if child.process is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGKILL)
