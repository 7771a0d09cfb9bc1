"""The scheduler's LoRA affinity (services/scheduler/routing.py): a request of an adapter
goes only to workers serving it, prefers one with it in a slot unless that one is busier by
more than the affinity is worth, hashes its blocks apart from the base model's, and its
placements are counted as affinity or load (registry.place_adapter)."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.registry import Registry
from services.scheduler.route_plan import plan_route
from services.scheduler.routing import WorkerView, rank_decode, rank_prefill
from shared.protocol import Heartbeat


def view(worker_id, load=0, adapters=("a", "b"), loaded=(), role="decode", cached=frozenset()):
    return WorkerView(
        worker_id, role, False, 100, load, cached,
        adapters=frozenset(adapters), adapters_loaded=frozenset(loaded),
    )  # fmt: skip


def test_an_adapter_goes_where_it_is_loaded_unless_that_worker_is_busy():
    workers = [view("w1"), view("w2", loaded=("a",)), view("w3", adapters=())]
    best = rank_decode(workers, [], 10, 16, load_penalty=1.0, adapter="a", affinity=4.0)
    assert [c.worker_id for c in best] == ["w2", "w1"]  # w3 does not serve it
    busy = [view("w1"), view("w2", load=5, loaded=("a",))]
    best = rank_decode(busy, [], 10, 16, load_penalty=1.0, adapter="a", affinity=4.0)
    assert best[0].worker_id == "w1"  # 5 requests outweigh the adapter's slot
    base = rank_decode(workers, [], 10, 16, load_penalty=1.0, adapter="", affinity=4.0)
    assert [c.worker_id for c in base] == ["w1", "w2", "w3"]  # no adapter: no affinity
    prefills = [view("p1", role="prefill"), view("p2", role="prefill", loaded=("b",))]
    assert rank_prefill(prefills, [], 1.0, "b", 4.0)[0].worker_id == "p2"


def test_a_plan_hashes_an_adapters_blocks_apart_and_says_when_none_serves_it():
    config = SchedulerConfig()
    tokens = list(range(40))
    base = plan_route([view("w1")], tokens, "m", "m", config)
    lora = plan_route([view("w1")], tokens, "m", "m", config, "a")
    assert base.hashes and set(base.hashes).isdisjoint(lora.hashes)
    cached = view("w1", cached=frozenset(base.hashes))
    assert plan_route([cached], tokens, "m", "m", config).decodes[0].overlap == 2
    assert plan_route([cached], tokens, "m", "m", config, "a").decodes[0].overlap == 0
    none = plan_route([view("w1", adapters=())], tokens, "m", "m", config, "a")
    assert not none.decodes and "with adapter a" in none.no_room


def test_placements_count_affinity_and_load_until_the_next_heartbeat():
    registry = Registry()
    beat = Heartbeat("w1", "both", "m", 0, 0, 10, 10, 16, adapters=["a"], adapters_loaded=[])
    registry.on_heartbeat(beat, 0.0)
    assert registry.place_adapter("w1", "a") is False  # it loads it
    assert registry.views()[0].adapters_loaded == {"a"}
    assert registry.place_adapter("w1", "a") is True  # the next one finds it there
    registry.on_heartbeat(beat, 1.0)  # its heartbeat: no longer in a slot
    assert registry.views()[0].adapters_loaded == frozenset()
