"""Following a PoolTarget as pure functions (services/pool_reconcile.py,
services/pool_targets.py): the live counts from a status, the adds and drains within the
bounds (at most --max-workers, at least one worker), cores for pinned pools, and the
newest-seq_no-per-publisher rule."""

from __future__ import annotations

from collections import Counter

from services.launch_plan import PinnedPool
from services.pool_reconcile import (
    PoolChanges,
    WorkerAdd,
    core_sizes,
    free_cores,
    live_counts,
    reconcile,
)
from services.pool_targets import TargetBook
from services.scale_cli import ScaleCommand, target_for
from shared.pool_messages import PoolTarget
from shared.protocol import Heartbeat, MeshStatus, WorkerStatus


def beat(worker_id: str, role: str, next_role: str = "", draining: bool = False) -> WorkerStatus:
    heartbeat = Heartbeat(worker_id, role, "m", 0, 0, 10, 10, 16, draining, next_role=next_role)
    return WorkerStatus(heartbeat, 0.0)


def target(prefill: int = 0, decode: int = 0, both: int = 0, seq_no: int = 1, by: str = "p"):
    return PoolTarget(by, seq_no, "", prefill, decode, both, "test")


def test_live_counts_follow_the_next_role_and_skip_draining_ignored_and_add_pending():
    status = MeshStatus(
        [
            beat("p0", "prefill"),
            beat("p1", "prefill", next_role="decode"),  # mid-change: counts as decode
            beat("d0", "decode", draining=True),  # drains: does not count
            beat("d1", "decode"),
            beat("d1-old", "decode"),  # an old incarnation the launcher ignores
        ],
        0,
        0,
        0,
    )
    counts = live_counts(status, ignored={"d1-old"}, pending=["both", "prefill"])
    assert counts == Counter({"prefill": 2, "decode": 2, "both": 1})


def test_reconcile_adds_the_missing_and_drains_the_extra_workers():
    live = Counter({"prefill": 2, "decode": 1})
    changes = reconcile(target(prefill=1, decode=2, both=1), live, max_workers=8)
    assert changes.drains == ("prefill",)
    assert changes.adds == (WorkerAdd("decode", ()), WorkerAdd("both", ()))
    assert changes.refused == ()
    # Once the counts show what was done, nothing more is done.
    done = Counter({"prefill": 1, "decode": 2, "both": 1})
    assert not reconcile(target(prefill=1, decode=2, both=1), done, max_workers=8)


def test_adds_stop_at_max_workers_counting_what_stays_after_the_drains():
    live = Counter({"prefill": 2, "decode": 1})
    changes = reconcile(target(prefill=1, decode=4), live, max_workers=4)
    # 3 live - 1 drained = 2 stay: room for 2 of the 3 decode workers wanted.
    assert changes.drains == ("prefill",)
    assert [a.role for a in changes.adds] == ["decode", "decode"]
    assert changes.refused == ("decode: at most 4 workers (--max-workers)",)


def test_at_least_one_worker_always_stays():
    changes = reconcile(target(), Counter({"prefill": 1, "decode": 2}), max_workers=8)
    assert changes.drains == ("prefill", "decode")  # one decode worker stays
    assert changes.refused == ("at least one worker always stays",)
    # A swap on one worker: the new one starts, the old one drains only once it is live.
    swap = reconcile(target(decode=1), Counter({"prefill": 1}), max_workers=8)
    assert (swap.adds, swap.drains) == ((WorkerAdd("decode", ()),), ())
    again = reconcile(target(decode=1), Counter({"prefill": 1, "decode": 1}), max_workers=8)
    assert (again.adds, again.drains) == ((), ("prefill",))


def test_pinned_workers_take_free_cores_or_the_add_is_refused():
    pools = (PinnedPool("prefill", (0, 1)), PinnedPool("decode", (2,)))
    sizes = core_sizes(pools)
    assert sizes == {"prefill": 2, "decode": 1, "both": 1}  # both: the smallest pool's
    assert core_sizes(()) == {}
    free = free_cores(range(8), held={0, 1, 2, 5, 7})
    assert free == [3, 4, 6]
    live = Counter({"prefill": 1, "decode": 1})
    changes = reconcile(target(prefill=3, decode=2), live, 8, free, sizes)
    # The first prefill gets 3,4; the second finds one core left and is refused; the
    # decode worker then takes the lowest free core.
    assert changes.adds == (WorkerAdd("prefill", (3, 4)), WorkerAdd("decode", (6,)))
    assert changes.refused == ("prefill: no 2 free core(s) for one more pinned worker",)
    assert reconcile(target(prefill=2), live, 8, [], sizes) == PoolChanges(
        (), ("decode",), ("prefill: no 2 free core(s) for one more pinned worker",)
    )


def test_only_a_newer_target_of_its_publisher_is_followed():
    book = TargetBook()
    assert book.current is None
    assert book.offer(target(decode=2, seq_no=5, by="planner-a"))
    assert not book.offer(target(decode=9, seq_no=5, by="planner-a"))  # repeated
    assert not book.offer(target(decode=9, seq_no=4, by="planner-a"))  # overtaken
    assert book.current.decode == 2
    assert book.offer(target(decode=3, seq_no=1, by="scale"))  # another publisher's own count
    assert book.current.decode == 3
    assert book.offer(target(decode=4, seq_no=6, by="planner-a"))
    assert (book.current.publisher, book.current.decode) == ("planner-a", 4)


def test_scale_publishes_the_whole_state_with_its_role_replaced():
    status = MeshStatus(
        [beat("p0", "prefill"), beat("d0", "decode"), beat("d1", "decode", draining=True)],
        0,
        0,
        0,
    )
    command = ScaleCommand(role="decode", replicas=3, reason="more streams")
    sent = target_for(command, status, seq_no=1234)
    assert sent == PoolTarget("scale", 1234, "", 1, 3, 0, "more streams")
