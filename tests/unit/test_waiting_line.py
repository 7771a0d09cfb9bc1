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


def test_a_wake_during_a_pass_starts_the_next_one_when_it_ends() -> None:
    """Room announced while a waiter's try is out (a heartbeat with free blocks, a
    completion) is not lost when that try is refused: the next pass starts at once, not at
    some later wake (none comes from a worker already idle; only the sweeper's tick did)."""
    line = WaitingLine()
    first, second = waiters(line, 1, 2)
    line.wake()
    assert has_turn(first)
    first.woken.clear()  # its try is out
    line.wake()  # room appeared meanwhile: no second pass while this one runs
    assert not has_turn(second)
    line.tried(first, asked=True)  # refused (it asked before the room): the pass ends ...
    assert has_turn(first) and not has_turn(second)  # ... and the next starts at once
    first.woken.clear()
    line.tried(first, asked=True)  # no wake during this one: the line sleeps
    assert not has_turn(first) and not has_turn(second)
    line.wake()
    first.woken.clear()
    line.wake()  # during a pass that ends with every turn taken, not with a refusal
    line.tried(first, asked=False)
    second.woken.clear()
    line.tried(second, asked=False)
    assert has_turn(first) and not has_turn(second)
    first.woken.clear()
    line.wake(backoff=True)  # the sweeper's tick during a pass: no pass after it
    line.tried(first, asked=True)
    assert not has_turn(first) and not has_turn(second)


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
