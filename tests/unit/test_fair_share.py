"""Fair service in the scheduler's waiting line (fair_share.py, waiting.py): virtual token
counters between tenants, a newly active tenant lifted to the active ones' lowest counter,
`priority` first, and shedding of whoever would be served last. A heavy tenant flooding the
line moves a light tenant's turn by at most one placement; first come, first served would
put it behind the whole flood."""

from __future__ import annotations

from services.scheduler.fair_share import FairShare
from services.scheduler.waiting import Waiter, WaitingLine

TOKENS = 100  # each request's prompt + max_tokens


JOINED: dict[int, list[Waiter]] = {}  # id(line) → its waiters, as the test joined them


def join(line: WaitingLine, name: str, arrival: float, tenant: str, priority: int = 0) -> Waiter:
    waiter = Waiter(name, arrival, 1e9, tenant, priority)
    line.join(waiter)
    JOINED.setdefault(id(line), []).append(waiter)
    return waiter


def serve_all(line: WaitingLine) -> list[str]:
    """Room for one request per pass: each turn's holder is placed (charged, gone)."""
    order, left = [], JOINED.pop(id(line))
    while len(line):
        line.wake()
        holder = next(w for w in left if w.woken.is_set())
        left.remove(holder)
        order.append(holder.request_id)
        line.fair.charge(holder.tenant, TOKENS)
        line.leave(holder)
    return order


def test_a_light_tenant_is_served_next_to_a_heavy_flood() -> None:
    line = WaitingLine()
    for i in range(10):
        join(line, f"heavy{i}", float(i), "heavy")
    join(line, "light", 10.0, "light")
    order = serve_all(line)
    assert order.index("light") <= 1  # first come, first served: 10
    assert [r for r in order if r != "light"] == [f"heavy{i}" for i in range(10)]


def test_counters_share_by_tokens_and_a_new_tenant_is_lifted() -> None:
    fair = FairShare()
    line = WaitingLine(fair)
    fair.charge("a", 5000)  # served a lot while nobody waited
    for i in range(4):
        join(line, f"b{i}", float(i), "b")
    join(line, "a0", 10.0, "a")
    join(line, "a1", 11.0, "a")
    order = serve_all(line)
    assert order[:4] == ["b0", "b1", "b2", "b3"]  # a has used more: b first
    fair2 = FairShare()
    line2 = WaitingLine(fair2)
    join(line2, "busy", 0.0, "busy")
    fair2.charge("busy", 700)
    join(line2, "newcomer", 1.0, "new")  # idle so far: lifted to busy's 700, no credit
    assert fair2.counters["new"] == 700
    assert fair2.lifted("new") == 700 and fair2.lifted("other") == 700


def test_priority_comes_before_tenants_and_arrival() -> None:
    line = WaitingLine()
    join(line, "late-urgent", 5.0, "heavy", priority=-1)
    join(line, "early", 1.0, "light")
    join(line, "later", 2.0, "light", priority=3)
    assert serve_all(line) == ["late-urgent", "early", "later"]


def test_who_would_be_served_last_is_shed() -> None:
    line = WaitingLine()
    assert not line.sorts_last(0, "heavy")  # nobody waits
    for i in range(3):
        join(line, f"heavy{i}", float(i), "heavy")
    line.fair.charge("heavy", 300)
    assert line.sorts_last(0, "heavy")  # one more of the flood: last
    assert not line.sorts_last(0, "light")  # lifted to heavy's counter at most: not last
    assert line.sorts_last(5, "light")  # a lower priority than all waiting: last
    assert not line.sorts_last(-1, "heavy")  # a higher one: first
