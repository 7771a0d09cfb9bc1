"""The scheduler's waiting line: placements that found no worker with room, in fair order.

A request that no worker took this time (every candidate busy, failed or lost, or none with
room in the registry) waits here, still counted against `max_queue`, until a *pass* gives it
a turn to try again. A pass starts when room may have appeared (`wake`: a heartbeat showing
more free blocks or less load, a worker joining, the sweeper's backoff tick) and hands the
turn to the waiters one at a time, each once, in fair order (fair_share.py: lower
`priority` first, then the tenant that has been served the fewest tokens, then the oldest
arrival; with one tenant and one priority, oldest first), so the next in that order gets
the first claim on new room and nobody wins it by polling faster. After its try a waiter
  - placed, refused for good, or gone (Cancel, timeout) → `leave`: the next one's turn;
  - waits again without having asked a worker (nothing in the registry fits it) →
    `tried(asked=False)`: the next one's turn (a big prompt does not block small ones);
  - waits again after workers refused it (the mesh is full for now) → `tried(asked=True)`:
    the pass ends; the next wake starts one from the oldest again.
A wake that comes while a pass runs is not lost: the room it announces may be after the
turns already taken in that pass, so another pass follows once this one ends (at most one,
however many wakes came). Without that, a waiter refused during a pass would sleep through
room that appeared while it asked, until some later wake (the sweeper's tick, or a
heartbeat with yet more room: none comes when the worker is already idle). The sweeper's
tick is only a backoff: it starts a pass when none runs, and never queues one.
A Cancel ends one request's wait at once; a wait also ends at its give-up time, and every
wait ends when the scheduler stops (`close`), so draining does not sit out the timeouts.

`ModelLines` keeps one line per model (a request's `model`), so the requests of a model
without room never hold up another model's; the tenants' counters are the mesh's, shared by
every line. Shedding by class (`sorts_last`): beyond the scheduler's shed limit, a request
that would get its turn after every waiter of its line is refused at once rather than queued.
"""

from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass, field
from enum import Enum

from services.scheduler.fair_share import FairShare


class WaitEnd(Enum):
    TURN = "turn"  # its turn to try again
    CANCELLED = "cancelled"  # a Cancel for it arrived
    TIMED_OUT = "timed_out"  # its give-up time passed
    CLOSED = "closed"  # the scheduler is stopping


@dataclass(slots=True)
class Waiter:
    request_id: str
    arrival: float  # when the submit reached the scheduler: the order of the line
    give_up: float  # clock time: min(request deadline, arrival + queue_timeout)
    tenant: str = ""  # SubmitRequest.tenant
    priority: int = 0  # SubmitRequest.priority: lower first
    reason: str = "other requests were waiting for room"  # why it waits: its last try
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    queued: bool = False  # it has been in the line (its placement waited)


class WaitingLine:
    def __init__(self, fair: FairShare | None = None) -> None:
        self._waiters: list[Waiter] = []  # by arrival
        self._holder: Waiter | None = None  # whose turn it is; None: no pass running
        self._had_turn: list[Waiter] = []  # in the pass running
        self._woken_meanwhile = False  # a wake came while the pass ran: another follows it
        self.fair = fair if fair is not None else FairShare()
        self.closed = False

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, waiter: Waiter) -> bool:
        return any(w is waiter for w in self._waiters)

    def join(self, waiter: Waiter) -> None:
        """Take a place by arrival (a later arrival that joined first stays behind it)."""
        if waiter not in self:
            waiter.queued = True
            at = bisect.bisect_right([w.arrival for w in self._waiters], waiter.arrival)
            self._waiters.insert(at, waiter)
            self.fair.joined(waiter.tenant)

    def leave(self, waiter: Waiter) -> None:
        """Out of the line for good; a turn it held goes to the next in order."""
        if waiter not in self:
            return
        self._waiters.remove(waiter)
        self.fair.left(waiter.tenant)
        if self._holder is waiter:
            self._give_turn()

    def wake(self, *, backoff: bool = False) -> None:
        """Room may have appeared: start a pass from the first in order, or, if one runs,
        another once it ends. A `backoff` wake (the sweeper's tick, which announces no
        room) starts a pass only when none runs."""
        if self._holder is None:
            self._start_pass()
        elif not backoff:
            self._woken_meanwhile = True

    def _start_pass(self) -> None:
        self._woken_meanwhile = False
        self._had_turn = []
        self._give_turn()

    def sorts_last(self, priority: int, tenant: str) -> bool:
        """Would a request of `tenant` at `priority`, joining now, come after every waiter:
        no earlier by priority nor by its tenant's counter, and behind at least its own
        tenant's backlog or someone it ranks after? False when none waits. (A tenant not
        waiting yet, lifted to the lowest counter, ties with the flood and is not shed.)"""
        active = bool(self.fair.waiting.get(tenant))
        counter = self.fair.counters.get(tenant, 0.0) if active else self.fair.lifted(tenant)
        newcomer = (priority, counter)
        waiting = [self.fair.key(w.priority, w.tenant) for w in self._waiters]
        if not waiting or any(newcomer < key for key in waiting):
            return False
        return active or any(newcomer > key for key in waiting)

    def tried(self, waiter: Waiter, asked: bool) -> None:
        """`waiter` used its turn and waits again: the pass goes on, or ends if it `asked`
        workers and they refused (the ones behind it would hear the same)."""
        if self._holder is not waiter:
            return
        if asked:
            self._end_pass()
        else:
            self._give_turn()

    def cancel(self, request_id: str) -> None:
        """End the wait of `request_id`, if it waits here."""
        for waiter in self._waiters:
            if waiter.request_id == request_id:
                waiter.cancelled = True
                waiter.woken.set()

    def close(self) -> None:
        """End every wait, now and from now on."""
        self.closed = True
        for waiter in self._waiters:
            waiter.woken.set()

    async def wait(self, waiter: Waiter, timeout: float) -> WaitEnd:
        """Until its turn, a Cancel, `close`, or `timeout` seconds."""
        try:
            await asyncio.wait_for(waiter.woken.wait(), max(0.0, timeout))
        except TimeoutError:
            return self._why_woken(waiter) or WaitEnd.TIMED_OUT
        waiter.woken.clear()
        return self._why_woken(waiter) or WaitEnd.TURN

    def _why_woken(self, waiter: Waiter) -> WaitEnd | None:
        if self.closed:
            return WaitEnd.CLOSED
        return WaitEnd.CANCELLED if waiter.cancelled else None

    def _give_turn(self) -> None:
        """To the first in order of those that have not had a turn in this pass."""
        due = [w for w in self._waiters if not any(w is t for t in self._had_turn)]
        if not due:
            self._end_pass()
            return
        self._holder = min(due, key=self._order)
        self._had_turn.append(self._holder)
        self._holder.woken.set()

    def _end_pass(self) -> None:
        """No turn is held now; a wake that came during the pass starts the next one."""
        self._holder = None
        if self._woken_meanwhile and self._waiters:
            self._start_pass()

    def _order(self, waiter: Waiter) -> tuple[int, float, float]:
        return (*self.fair.key(waiter.priority, waiter.tenant), waiter.arrival)


class ModelLines:
    """One `WaitingLine` per model, made on first use; wake, cancel and close reach all."""

    def __init__(self) -> None:
        self._lines: dict[str, WaitingLine] = {}
        self.fair = FairShare()  # the tenants' counters: the mesh's, every line's
        self.closed = False

    def of(self, model: str) -> WaitingLine:
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = WaitingLine(self.fair)
            if self.closed:
                line.close()
        return line

    def wake(self, *, backoff: bool = False) -> None:
        """Room may have appeared: every model's line (a request of no model takes any)."""
        for line in self._lines.values():
            line.wake(backoff=backoff)

    def cancel(self, request_id: str) -> None:
        for line in self._lines.values():
            line.cancel(request_id)

    def close(self) -> None:
        self.closed = True
        for line in self._lines.values():
            line.close()
