"""Worker registry: heartbeats, expiry after three missed beats, KV events in seq order,
placements as load until the next heartbeat."""

from __future__ import annotations

from services.scheduler.registry import Registry
from shared.protocol import Heartbeat, KVEvents
from shared.sleep_level import SleepLevel


def beat(worker_id: str = "w1", role: str = "decode", free: int = 100, running: int = 0):
    return Heartbeat(worker_id, role, "m", running, 0, free, 200, 16)


def test_expiry_after_three_missed_heartbeats():
    registry = Registry(heartbeat_timeout=3.0)
    registry.on_heartbeat(beat("w1"), now=100.0)
    registry.on_heartbeat(beat("w2"), now=100.0)
    registry.on_heartbeat(beat("w2"), now=102.5)
    registry.assign("w1", "r1", deadline=200.0)
    assert registry.expire(now=102.9) == []
    lost = registry.expire(now=103.1)
    assert [s.heartbeat.worker_id for s in lost] == ["w1"]
    assert list(lost[0].assigned) == ["r1"]
    assert "w1" not in registry and "w2" in registry


def test_touch_all_after_own_outage_spares_workers():
    registry = Registry(heartbeat_timeout=3.0)
    registry.on_heartbeat(beat(), now=100.0)
    registry.touch_all(now=110.0)
    assert registry.expire(now=112.0) == []


def test_kv_events_in_order_and_gap_resets():
    registry = Registry()
    registry.on_kv_events(KVEvents("w1", 0, stored=[1]))  # unknown worker: ignored
    registry.on_heartbeat(beat(), now=0.0)
    registry.on_kv_events(KVEvents("w1", 5, stored=[1, 2, 3]))  # first seen: starts here
    registry.on_kv_events(KVEvents("w1", 6, stored=[4], removed=[2]))
    assert registry.views()[0].cached == {1, 3, 4}
    registry.on_kv_events(KVEvents("w1", 8, stored=[9]))  # 7 was lost: start over
    assert registry.views()[0].cached == {9}
    registry.on_kv_events(KVEvents("w1", 0, stored=[7]))  # the worker restarted
    assert registry.views()[0].cached == {7}
    registry.on_kv_events(KVEvents("w1", 1, removed=[7], stored=[8]))
    assert registry.views()[0].cached == {8}


def test_placements_count_as_load_until_next_heartbeat():
    registry = Registry()
    registry.on_heartbeat(beat(free=100, running=1), now=0.0)
    registry.assign("w1", "r1", deadline=50.0, num_tokens=40)  # 3 blocks
    view = registry.views()[0]
    assert (view.load, view.free_blocks) == (2, 97)
    registry.on_heartbeat(beat(free=97, running=2), now=1.0)
    view = registry.views()[0]
    assert (view.load, view.free_blocks) == (2, 97)
    assert registry.status()[0].assigned == ["r1"]


def test_forget_on_cancel_and_after_deadline():
    registry = Registry()
    registry.on_heartbeat(beat(), now=0.0)
    registry.assign("w1", "r1", deadline=10.0)
    registry.assign("w1", "r2", deadline=20.0)
    registry.assign("w1", "r3", deadline=30.0)
    registry.forget("r3")
    registry.forget_past_deadline(now=15.0)
    assert registry.status()[0].assigned == ["r2"]


def test_a_heartbeat_says_when_a_worker_may_have_new_room():
    registry = Registry()
    assert registry.on_heartbeat(beat(free=10, running=4), now=0.0)  # joined
    assert not registry.on_heartbeat(beat(free=10, running=4), now=1.0)  # nothing changed
    assert not registry.on_heartbeat(beat(free=8, running=5), now=2.0)  # fuller
    assert registry.on_heartbeat(beat(free=12, running=5), now=3.0)  # blocks freed
    assert registry.on_heartbeat(beat(free=12, running=3), now=4.0)  # requests finished
    draining = Heartbeat("w1", "decode", "m", 0, 0, 50, 200, 16, draining=True)
    assert not registry.on_heartbeat(draining, now=5.0)  # takes nothing new, however empty
    assert registry.on_heartbeat(beat(free=50), now=6.0)  # back from draining


def test_a_role_change_is_seen_in_the_views_and_its_end_is_new_room():
    registry = Registry()
    assert registry.on_heartbeat(beat("w1", "decode"), now=0.0)
    (view,) = registry.views()
    assert (view.role, view.changing, view.placeable) == ("decode", False, True)
    changing = Heartbeat("w1", "decode", "m", 0, 0, 100, 200, 16, next_role="prefill")
    assert not registry.on_heartbeat(changing, now=1.0)
    (view,) = registry.views()
    assert (view.role, view.changing, view.placeable) == ("decode", True, False)
    assert registry.on_heartbeat(beat("w1", "prefill"), now=2.0)  # changed: room anew
    (view,) = registry.views()
    assert (view.role, view.changing, view.placeable) == ("prefill", False, True)


def test_a_worker_of_another_engine_for_the_same_model_is_refused():
    registry = Registry()
    native = beat("n1")
    vllm = Heartbeat("v1", "decode", "m", 0, 0, 100, 200, 16, engine="vllm")
    other_model = Heartbeat("v2", "decode", "other", 0, 0, 100, 200, 16, engine="vllm")
    assert registry.on_heartbeat(native, now=0.0)
    assert not registry.on_heartbeat(vllm, now=0.0)
    assert not registry.on_heartbeat(vllm, now=1.0)  # every beat: still refused
    assert registry.on_heartbeat(other_model, now=0.0)
    assert "v1" not in registry and "n1" in registry and "v2" in registry
    assert registry.refused == {"v1": "engine vllm: m runs on {'native'}"}


def test_a_silent_worker_is_suspect_until_it_answers_or_is_lost():
    registry = Registry(heartbeat_timeout=3.0)
    registry.on_heartbeat(beat("w1"), now=100.0)
    registry.on_heartbeat(beat("w2"), now=100.0)
    registry.on_heartbeat(beat("w2"), now=102.5)
    assert registry.silent(now=102.9) == []
    (suspect,) = registry.silent(now=103.1)
    assert suspect.heartbeat.worker_id == "w1"
    assert registry.silent(now=104.0) == []  # probed once, not again
    assert [v.worker_id for v in registry.views()] == ["w2"]  # never placed on meanwhile
    registry.answered("w1", epoch=0, now=104.0)
    assert sorted(v.worker_id for v in registry.views()) == ["w1", "w2"]
    assert registry.lose("w1", epoch=0) is None  # it answered: not lost
    assert [s.heartbeat.worker_id for s in registry.silent(now=107.5)] == ["w1", "w2"]
    assert registry.lose("w1", epoch=0).heartbeat.worker_id == "w1"
    assert "w1" not in registry


def test_a_heartbeat_while_probed_keeps_the_worker():
    registry = Registry(heartbeat_timeout=3.0)
    registry.on_heartbeat(beat("w1"), now=100.0)
    registry.silent(now=103.5)
    registry.on_heartbeat(beat("w1"), now=103.6)
    assert registry.lose("w1", epoch=0) is None
    assert "w1" in registry


def test_a_newer_process_under_the_same_id_replaces_the_old_one():
    registry = Registry(heartbeat_timeout=3.0)
    old, new = beat("w1"), beat("w1")
    old.epoch, new.epoch = 1000, 2000
    registry.on_heartbeat(old, now=100.0)
    registry.assign("w1", "r1", deadline=200.0)
    assert registry.replaced(old) is None  # the same process
    gone = registry.replaced(new)
    assert gone is not None and gone.epoch == 1000 and list(gone.assigned) == ["r1"]
    registry.on_heartbeat(new, now=100.5)
    assert registry.replaced(old) is None
    registry.on_heartbeat(old, now=101.0)  # the old process, late: ignored
    (status,) = registry.status()
    assert status.heartbeat.epoch == 2000 and status.assigned == []


def test_the_scheduler_hashes_with_its_workers_block_size_one_size_per_model():
    registry = Registry()
    assert registry.block_size("m", 16) == 16  # no worker yet: the default
    registry.on_heartbeat(Heartbeat("v1", "decode", "m", 0, 0, 100, 200, 32), now=0.0)
    registry.on_heartbeat(Heartbeat("o1", "decode", "other", 0, 0, 100, 200, 16), now=0.0)
    assert (registry.block_size("m", 16), registry.block_size("other", 32)) == (32, 16)
    assert not registry.on_heartbeat(Heartbeat("v2", "decode", "m", 0, 0, 100, 200, 16), 0.0)
    assert "v2" not in registry
    assert registry.refused == {"v2": "blocks of 16 tokens: m hashes {32}"}


def test_a_scheduler_given_a_block_size_refuses_workers_of_another():
    registry = Registry(block_size=16)
    assert not registry.on_heartbeat(Heartbeat("v1", "decode", "m", 0, 0, 100, 200, 32), 0.0)
    assert registry.on_heartbeat(Heartbeat("n1", "decode", "m", 0, 0, 100, 200, 16), 0.0)
    assert registry.block_size("m", 32) == 16 and "v1" in registry.refused


def test_the_schedulers_own_outage_clears_suspicion():
    registry = Registry(heartbeat_timeout=3.0)
    registry.on_heartbeat(beat("w1"), now=100.0)
    registry.on_heartbeat(beat("w2"), now=100.0)
    registry.silent(now=104.0)
    registry.touch_all(now=105.0)  # reconnected: the probes out meanwhile decide nothing
    assert registry.lose("w1", epoch=0) is None
    registry.recheck("w2")
    assert registry.lose("w2", epoch=0) is None
    assert len(registry.views()) == 2


def test_a_sleeping_worker_is_no_candidate_until_it_wakes_up():
    registry = Registry()
    registry.on_heartbeat(beat("w1"), now=0.0)
    asleep = beat("w1")
    asleep.sleep_level = SleepLevel.KV_FREED
    registry.on_heartbeat(asleep, now=1.0)
    assert registry.views() == [] and "w1" in registry  # registered, never placed on
    assert registry.on_heartbeat(beat("w1"), now=2.0)  # awake: room the waiting line may use
    assert [v.worker_id for v in registry.views()] == ["w1"]
