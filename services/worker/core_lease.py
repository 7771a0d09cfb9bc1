"""Cores shared by the workers of one machine: a worker steps on its own core, borrows the
cores of workers that are idle, and a decode worker yields its core to a prefill backlog
(the rules in full: docs/ARCHITECTURE.md, "Cores shared by one machine's workers").

Every lock and flag (`claim-N`, `core-N`, `active-N`, `backlog-N`, `overdue-N`, `yields-N`) is
a `flock` on a file in a per-user directory. The one subtle rule: a lock vanishes with the
process that held it, so a killed worker never strands a core, but a wedged one keeps it; an
owner therefore waits for its home core `HOME_WAIT_LIMIT_S` at most, then steps on it anyway,
and at once when the holder is a stopped process (SIGSTOP).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path

from services.worker.lock_holders import held_by_stopped

# A decode worker waits for a prefill backlog this long per step at most: long enough for a
# burst of 16 prompts of 100 tokens on 2 cores, so its last step does not run beside a decode
# step (docs/engine-speed.md); under sustained overload the running streams get one step in
# this long.
YIELD_LIMIT_S = 1.5
# A prefill worker with a backlog waits this long at most for an active decode worker to
# yield its core: the rest of one decode step. Stepping at once on its own core instead left
# the decode's idle for the whole prefill step, the decode waiting on the backlog. The wait
# stops for commands, so prompts that arrive meanwhile join the step (docs/engine-speed.md,
# "Decode steps beside a burst" and "A prefill's wait that answers its commands").
BORROW_WAIT_S = 0.5
# An owner waits this long at most for its home core, held by a borrower's step (or by a worker
# that shares the home): far beyond any step this CPU path takes (0.1-0.5 s for SmolLM2's
# 256-token steps on 2 cores; ~10 s for an 8B model's), so only a wedged worker outlasts it.
HOME_WAIT_LIMIT_S = 60.0
# While it waits for its home, an owner looks this often whether the holder is a stopped
# process (lock_holders.py), which would hold it for as long as it is stopped: it does not
# wait on one.
STOPPED_CHECK_S = 0.25
_YIELD_POLL_S = 0.002
_HOME_POLL_S = 0.0005  # a borrower lets the home go at its step's end: take it soon after
ROLES = ("prefill", "decode", "both")

log = logging.getLogger(__name__)


class Wait(IntEnum):
    """How a wait on another worker's flags ended."""

    CLEARED = 0
    TIMED_OUT = 1
    INTERRUPTED = 2


def _never() -> bool:
    return False


class _PolledWait:
    """A wait on another worker, polled: it gives up `limit_s` after its first poll, and only
    an interrupted wait keeps its give-up time, for the call that resumes it."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.give_up: float | None = None

    def run(
        self, waiting: Callable[[], bool], limit_s: float, interrupted: Callable[[], bool] = _never
    ) -> Wait:
        """Poll `waiting` until it is false, `interrupted()` is true, or the give-up time."""
        if self.give_up is None:
            self.give_up = time.monotonic() + limit_s
        while waiting():
            if time.monotonic() >= self.give_up:
                self.give_up = None
                return Wait.TIMED_OUT
            if interrupted():
                return Wait.INTERRUPTED
            time.sleep(self.poll_s)
        self.give_up = None
        return Wait.CLEARED


def default_dir() -> Path:
    """Where the lock files of this machine's workers live (shared memory when there is)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"splitserve-cores-{os.getuid()}"


def machine_cores() -> int:
    """Cores this process may run on (its affinity mask, as a container sets it)."""
    return len(os.sched_getaffinity(0))


class CoreLease:
    def __init__(
        self, cores: int | None = None, directory: Path | None = None, role: str = "both"
    ) -> None:
        """`role`: the worker's; a prefill worker raises backlogs, a decode worker yields to
        them, a worker of both roles does neither (its own scheduler mixes the two)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.role = role
        self.cores = cores or machine_cores()
        self.directory = directory or default_dir()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._files = [self._open(f"core-{i}") for i in range(self.cores)]
        self._actives = [self._open(f"active-{i}") for i in range(self.cores)]
        self._backlogs = [self._open(f"backlog-{i}") for i in range(self.cores)]
        self._overdues = [self._open(f"overdue-{i}") for i in range(self.cores)]
        self._yielders = [self._open(f"yields-{i}") for i in range(self.cores)]
        self._claim, self.home = self._claim_home()
        if role == "decode":  # held for life: this core's owner yields to backlogs
            fcntl.flock(self._yielders[self.home], fcntl.LOCK_SH)
        self._held: list[int] = []
        self._active = False
        self._backlog = False
        self._overdue = False
        self._turn_wait = _PolledWait(_YIELD_POLL_S)  # on another worker's flags
        self._yield_wait = _PolledWait(_YIELD_POLL_S)  # a prefill's, on the decodes' yields
        self._home_wait = _PolledWait(_HOME_POLL_S)  # for the home core
        self._stopped_seen: set[int] = set()  # stopped holders of the home logged already

    def acquire(self, interrupted: Callable[[], bool] = _never) -> int | None:
        """Raise the active flag, take the home core (waiting for a borrower's step,
        `HOME_WAIT_LIMIT_S` at most) and borrow the idle workers' cores; returns how many
        cores this step runs on (>= 1). A decode worker first waits out a prefill backlog, a
        prefill worker an overdue decode step (`YIELD_LIMIT_S` at most), and then, with a
        backlog, active decode workers' yields (`BORROW_WAIT_S` at most). Once
        `interrupted()` is true during any of those waits or the wait for the home, returns
        None, holding no core: call again to wait on (each limit counts from the first call,
        until a step is acquired or `idle()`)."""
        if self.role == "decode":
            if self._yield_to_backlog(interrupted) is Wait.INTERRUPTED:
                return None
        elif self.role == "prefill" and self._some_overdue():
            self._lower_active()  # the overdue decode step borrows this core
            overdue = self._turn_wait.run(self._some_overdue, YIELD_LIMIT_S, interrupted)
            if overdue is Wait.INTERRUPTED:
                return None
        self._turn_wait.give_up = None  # a resumed wait may have found nothing left to wait for
        if not self._active:
            fcntl.flock(self._actives[self.home], fcntl.LOCK_SH)
            self._active = True
        home = self._take_home(interrupted)
        if home is Wait.INTERRUPTED:
            return None
        self._held = [self.home] if home is Wait.CLEARED else []
        self._borrow([core for core in range(self.cores) if core != self.home])
        wants_yields = self.role == "prefill" and self._backlog and not self._some_overdue()
        if wants_yields and self._borrow_from_yielders(interrupted) is Wait.INTERRUPTED:
            self._unlock_held()
            return None
        self._yield_wait.give_up = None  # a resumed wait may have found no backlog left
        return max(1, len(self._held))

    def _take_home(self, interrupted: Callable[[], bool]) -> Wait:
        """Lock the home core: CLEARED once held; TIMED_OUT when another worker held it past
        `HOME_WAIT_LIMIT_S`, or holds it stopped (SIGSTOP: it holds it for as long as it is
        stopped); logged, and the step then runs on it without the lock."""
        home, stopped = self._files[self.home], [0]
        checked = [float("-inf")]

        def waiting() -> bool:
            if _try_lock(home):
                return False
            if time.monotonic() - checked[0] >= STOPPED_CHECK_S:
                checked[0] = time.monotonic()
                stopped[0] = held_by_stopped(home) or 0
            return not stopped[0]

        wait = self._home_wait.run(waiting, HOME_WAIT_LIMIT_S, interrupted)
        if stopped[0]:
            if stopped[0] not in self._stopped_seen:
                self._stopped_seen.add(stopped[0])
                log.warning(
                    "core lease: core %d is held by process %d, which is stopped; stepping "
                    "on it anyway while it is",
                    self.home,
                    stopped[0],
                )
            return Wait.TIMED_OUT
        if wait is Wait.TIMED_OUT:
            log.warning(
                "core lease: core %d is still held by another worker's step after %.0f s "
                "(a stopped or stuck worker?); stepping on it anyway",
                self.home,
                HOME_WAIT_LIMIT_S,
            )
        return wait

    def _borrow(self, cores: list[int]) -> None:
        for core in cores:
            if self._idle(core) and _try_lock(self._files[core]):
                self._held.append(core)

    def _borrow_from_yielders(self, interrupted: Callable[[], bool]) -> Wait:
        """Borrow the cores of active decode workers once they yield: this backlog is up,
        so each lowers its flag as its next step starts."""
        yielding = [
            core
            for core in range(self.cores)
            if core != self.home
            and core not in self._held
            and not self._idle(core)
            and not _free(self._yielders[core])
        ]
        if not yielding:
            return Wait.CLEARED
        wait = self._yield_wait.run(
            lambda: not all(map(self._idle, yielding)), BORROW_WAIT_S, interrupted
        )
        if wait is not Wait.INTERRUPTED:
            self._borrow(yielding)
        return wait

    def release(self) -> None:
        """After a step: every core goes back (the active flag stays up, unless a decode turn
        is overdue: then the prefill's, or the decode's own while a backlog waits, comes down
        first, so the next step on the other side finds this core idle)."""
        if self.role == "prefill" and self._some_overdue():
            self._lower_active()
        if self._overdue and self._some_backlog():
            self._lower_active()
        self._unlock_held()
        if self._overdue:
            fcntl.flock(self._overdues[self.home], fcntl.LOCK_UN)
            self._overdue = False

    def _unlock_held(self) -> None:
        for core in self._release_order():
            fcntl.flock(self._files[core], fcntl.LOCK_UN)
        self._held = []

    def _release_order(self) -> list[int]:
        """The held cores, those that a waiting worker may want last: a worker wakes on its
        home core and then borrows the others, so they must be free by then. The home goes
        last while this worker is active (a worker sharing it may wait on it), first once
        it lowered its flag for an overdue turn; a borrowed core goes last once its owner
        is active again (the owner waits on it)."""
        waited = [
            core
            for core in self._held
            if (self._active if core == self.home else not self._idle(core))
        ]
        return [core for core in self._held if core not in waited] + waited

    def set_backlog(self, backlog: bool) -> None:
        """After a step or a command: whether prompts wait to be prefilled, in whole or in
        part (a prefill worker's only)."""
        if self.role != "prefill" or backlog == self._backlog:
            return
        fcntl.flock(self._backlogs[self.home], fcntl.LOCK_SH if backlog else fcntl.LOCK_UN)
        self._backlog = backlog

    def idle(self) -> None:
        """No work until further notice: others may borrow the home core."""
        self.set_backlog(False)
        self._lower_active()
        self._turn_wait.give_up = self._home_wait.give_up = self._yield_wait.give_up = None

    def _lower_active(self) -> None:
        if self._active:
            fcntl.flock(self._actives[self.home], fcntl.LOCK_UN)
            self._active = False

    def _yield_to_backlog(self, interrupted: Callable[[], bool]) -> Wait:
        """Wait for the prefill backlogs to clear; if they outlast `YIELD_LIMIT_S`, raise
        the overdue flag for the coming step."""
        if not self._some_backlog():
            return Wait.CLEARED
        self._lower_active()  # the prefill's next step borrows this core
        wait = self._turn_wait.run(self._some_backlog, YIELD_LIMIT_S, interrupted)
        if wait is Wait.TIMED_OUT:
            fcntl.flock(self._overdues[self.home], fcntl.LOCK_SH)
            self._overdue = True
        return wait

    def close(self) -> None:
        self.release()
        flags = (*self._actives, *self._backlogs, *self._overdues, *self._yielders)
        for f in (*self._files, *flags, self._claim):
            os.close(f)

    def _claim_home(self) -> tuple[int, int]:
        """(the claim file held for life, the home core): the first unclaimed core, else one
        shared by pid."""
        for core in range(self.cores):
            claim = self._open(f"claim-{core}")
            if _try_lock(claim):
                return claim, core
            os.close(claim)
        core = os.getpid() % self.cores
        return self._open(f"claim-{core}"), core

    def _some_backlog(self) -> bool:
        """Whether a prefill worker of this machine has prompts to prefill."""
        return any(not _free(flag) for flag in self._backlogs)

    def _some_overdue(self) -> bool:
        """Whether a decode worker of this machine waited out a backlog and now steps."""
        return any(not _free(flag) for flag in self._overdues)

    def _idle(self, core: int) -> bool:
        """Whether no worker whose home is `core` has work (none holds its active flag)."""
        return _free(self._actives[core])

    def _open(self, name: str) -> int:
        return os.open(self.directory / name, os.O_RDWR | os.O_CREAT, 0o600)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _free(flag: int) -> bool:
    """Whether no process holds `flag` (a shared or exclusive flock)."""
    if not _try_lock(flag):
        return False
    fcntl.flock(flag, fcntl.LOCK_UN)
    return True
