"""The scheduler's waiting line on its own: turns in arrival order, a pass that goes on past
waiters that asked nobody and ends at one that workers refused, Cancel, close, timeouts."""

from __future__ import annotations

import asyncio

from services.scheduler.waiting import WaitEnd, Waiter, WaitingLine


def waiters(line: WaitingLine, *arrivals: float) -> list[Waiter]:
    joined = [Waiter(f"r{a:g}", a, give_up=1e9) for a in arrivals]
    for waiter in joined:
        line.join(waiter)
    return joined


def has_turn(waiter: Waiter) -> bool:
    return waiter.woken.is_set()


def test_a_pass_goes_oldest_first_and_ends_where_workers_refused() -> None:
    line = WaitingLine()
    second, first, third = waiters(line, 2, 1, 3)  # joined out of order: placed by arrival
    line.wake()
    assert [has_turn(w) for w in (first, second, third)] == [True, False, False]
    line.wake()  # a pass runs: no second one
    line.tried(first, asked=False)  # nothing fitted it: the next one's turn
    assert has_turn(second) and not has_turn(third)
    line.leave(second)  # placed: the next one's turn
    assert has_turn(third)
    line.tried(third, asked=True)  # workers refused it: the pass ends
    for waiter in (first, third):
        waiter.woken.clear()
    line.wake()  # the next pass starts from the oldest again
    assert has_turn(first) and not has_turn(third)
    assert len(line) == 2


def test_waits_end_on_turn_cancel_close_or_timeout() -> None:
    async def scenario() -> None:
        line = WaitingLine()
        first, second = waiters(line, 1, 2)
        assert await line.wait(first, 0.01) is WaitEnd.TIMED_OUT
        line.wake()
        assert await line.wait(first, 1) is WaitEnd.TURN
        line.cancel("r2")
        assert await line.wait(second, 1) is WaitEnd.CANCELLED
        line.leave(second)
        line.close()
        assert await line.wait(first, 1) is WaitEnd.CLOSED

    asyncio.run(scenario())


def test_a_waiter_that_times_out_holding_the_turn_passes_it_on() -> None:
    line = WaitingLine()
    first, second = waiters(line, 1, 2)
    line.wake()
    line.leave(first)
    assert has_turn(second) and len(line) == 1
    line.leave(first)  # already gone: nothing changes
    assert len(line) == 1
