"""The scheduler's waiting line: placements that found no worker with room, in arrival order.

A request that no worker took this time (every candidate busy, failed or lost, or none with
room in the registry) waits here, still counted against `max_queue`, until a *pass* gives it
a turn to try again. A pass starts when room may have appeared (`wake`: a heartbeat showing
more free blocks or less load, a worker joining, the sweeper's backoff tick) and hands the
turn to the waiters one at a time, oldest arrival first, so the oldest gets the first claim
on new room and nobody wins it by polling faster. After its try a waiter
  - placed, refused for good, or gone (Cancel, timeout) → `leave`: the next one's turn;
  - waits again without having asked a worker (nothing in the registry fits it) →
    `tried(asked=False)`: the next one's turn (a big prompt does not block small ones);
  - waits again after workers refused it (the mesh is full for now) → `tried(asked=True)`:
    the pass ends; the next wake starts one from the oldest again.
A Cancel ends one request's wait at once; a wait also ends at its give-up time, and every
wait ends when the scheduler stops (`close`), so draining does not sit out the timeouts.

`ModelLines` keeps one line per model (a request's `model`), so the requests of a model
without room never hold up another model's.
"""

from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass, field
from enum import Enum


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
    reason: str = "other requests were waiting for room"  # why it waits: its last try
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    queued: bool = False  # it has been in the line (its placement waited)


class WaitingLine:
    def __init__(self) -> None:
        self._waiters: list[Waiter] = []  # by arrival
        self._holder: Waiter | None = None  # whose turn it is; None: no pass running
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

    def leave(self, waiter: Waiter) -> None:
        """Out of the line for good; a turn it held goes to the one after it."""
        if waiter not in self:
            return
        at = self._waiters.index(waiter)
        del self._waiters[at]
        if self._holder is waiter:
            self._give_turn(at)

    def wake(self) -> None:
        """Room may have appeared: start a pass from the oldest waiter, unless one runs."""
        if self._holder is None:
            self._give_turn(0)

    def tried(self, waiter: Waiter, asked: bool) -> None:
        """`waiter` used its turn and waits again: the pass goes on, or ends if it `asked`
        workers and they refused (the ones behind it would hear the same)."""
        if self._holder is not waiter:
            return
        if asked:
            self._holder = None
        else:
            self._give_turn(self._waiters.index(waiter) + 1)

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

    def _give_turn(self, at: int) -> None:
        self._holder = self._waiters[at] if at < len(self._waiters) else None
        if self._holder is not None:
            self._holder.woken.set()


class ModelLines:
    """One `WaitingLine` per model, made on first use; wake, cancel and close reach all."""

    def __init__(self) -> None:
        self._lines: dict[str, WaitingLine] = {}
        self.closed = False

    def of(self, model: str) -> WaitingLine:
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = WaitingLine()
            if self.closed:
                line.close()
        return line

    def wake(self) -> None:
        """Room may have appeared: every model's line (a request of no model takes any)."""
        for line in self._lines.values():
            line.wake()

    def cancel(self, request_id: str) -> None:
        for line in self._lines.values():
            line.cancel(request_id)

    def close(self) -> None:
        self.closed = True
        for line in self._lines.values():
            line.close()
