"""Cores shared by the workers of one machine: a worker steps on its own core and borrows the
cores of workers that are idle.

`splitserve up` puts a prefill and a decode worker on one machine. With one thread each, the
decode worker leaves a core idle whenever prefill has nothing to do; with all cores each,
they fight over the cores whenever both are busy (OpenMP threads that wait on a preempted
peer lose far more than they gain). The lease gives each step the cores nobody else is
stepping on:

- Each worker claims a home core at start (a `claim-N` lock held for its lifetime; when
  every core is claimed, workers share homes, and so take turns).
- A worker with work raises its home's `active-N` flag (a shared lock) until it has none
  again (`idle()`); a borrower leaves the cores of active workers alone.
- A step holds its home core's `core-N` lock, and borrows `core-M` of every other core whose
  owner is not active; it runs with one torch thread per core held, and lets every lock go
  after the step. An owner that wakes up raises its flag first, then waits for its core:
  a borrower finishes its current step and borrows that core no more.

First tokens come first. A prefill worker with prompts still to prefill (a new arrival,
or the rest of a burst or of a long prompt that one step's token budget cannot take) raises
its home's `backlog-N` flag; a decode worker about to step while some prefill has a backlog
lowers its active flag and waits for that backlog to clear, at most `YIELD_LIMIT_S` per step,
so the prefill steps on every core. That is one engine stepping on two cores, as vLLM does with
a prompt, instead of two on one each: a burst's last first token comes about twice as soon,
and the running streams pause for as long. A prefill worker that finds a decode worker active
(between its steps, or in one) as its step starts waits for that decode to yield
(`BORROW_WAIT_S` at most, about one decode step), rather than step on its own core while the
decode's idles.

A worker waiting on a backlog, on a turn or on a decode's yield still answers its commands:
`acquire(interrupted)` returns None, holding nothing, once `interrupted()` is true, and the
engine thread applies what came in (a decode worker's KV reservations, which the scheduler
awaits before it hands the prompt to the prefill worker; a prefill worker's new prompts, which
then join the step it waited to take) and asks again; the wait's limit runs on across such
calls. A decode worker that did not answer until its wait ended held the next prompts back
from the very prefill it was waiting on: they reached the prefill one a step.

A decode worker that waits out the limit takes a turn rather than a share: it raises its home's
`overdue-N` flag for one step, a prefill worker finishing a step lowers its active flag before
it lets its cores go and steps again only once no turn is overdue (at most `YIELD_LIMIT_S`),
so the decode step runs on every core and the prefill then has them all back. Sharing them
instead (the decode on its core, the prefill on the other) leaves a core idle for most of the
prefill's step once the short decode step is done, since a step's thread count is fixed when
it starts.

Locks are `flock`s on files in a per-user directory, so they vanish with the process that
held them: a worker killed mid-step never strands a core. A worker alive but wedged in a step
(stopped, or stuck in a native call) would keep them: an owner waits for its home core
`HOME_WAIT_LIMIT_S` at most, then logs it and steps on that core regardless (sharing it with
the wedged step, if that ever goes on), and answers its commands while it waits.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path

# A decode worker waits for a prefill backlog this long per step at most: long enough for a
# burst of 16 prompts of 100 tokens on 2 cores (7 steps of ~0.2 s), so its last step does
# not run beside a decode step (at 1.0 s it did, 0.31 s instead of 0.18 s); under sustained
# overload the running streams get one step in this long.
YIELD_LIMIT_S = 1.5
# A prefill worker with a backlog waits this long at most for an active decode worker to
# yield its core: the rest of one decode step (16 rows: ~0.1 s on 2 cores of an AVX2 host).
# Stepping at once on its own core instead left the decode's idle for the whole prefill step,
# the decode waiting on the backlog (2026-12-03, c=16 through the mesh: 9 of 17 prefill steps
# of a wave took 1 core, 0.48 s each against 0.31 s on 2). The wait stops for commands, so
# prompts that arrive meanwhile join the step (2026-12-06, c=16 through the mesh, 7 pairs
# alternated: 552 -> 599 tok/s, TTFT p99 1085 -> 990 ms, medians).
BORROW_WAIT_S = 0.5
# An owner waits this long at most for its home core, held by a borrower's step (or by a worker
# that shares the home): far beyond any step this CPU path takes (0.1-0.5 s for SmolLM2's
# 256-token steps on 2 cores; ~10 s for an 8B model's), so only a wedged worker outlasts it.
HOME_WAIT_LIMIT_S = 60.0
_YIELD_POLL_S = 0.002
_HOME_POLL_S = 0.0005  # a borrower lets the home go at its step's end: take it soon after
ROLES = ("prefill", "decode", "both")

log = logging.getLogger(__name__)


class Wait(Enum):
    """How a wait on another worker's flags ended."""

    CLEARED = "cleared"
    TIMED_OUT = "timed out"
    INTERRUPTED = "interrupted"


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
        `HOME_WAIT_LIMIT_S` (logged; the step then runs on it without the lock)."""
        home = self._files[self.home]
        wait = self._home_wait.run(lambda: not _try_lock(home), HOME_WAIT_LIMIT_S, interrupted)
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
