"""Predicted against actual prefix hits: the scheduler's registry learns each worker's
second KV tier from its KV events and weighs those blocks by what loading saves; each
placement's predicted hit is compared with what the worker reports, and a divergence beyond
the bound is counted and logged, at most once per interval."""

from __future__ import annotations

import logging
from dataclasses import replace

from prometheus_client import CollectorRegistry

from services.scheduler.hit_check import LOG_EVERY_S, HitBook, predicted_tokens
from services.scheduler.measures import UNMEASURED_TIER_WEIGHT, tier_weight
from services.scheduler.registry import Registry
from shared.kv_tier_messages import TierCounters
from shared.protocol import FirstToken, Heartbeat, KVEvents


def beat(**fields) -> Heartbeat:
    return replace(Heartbeat("w1", "prefill", "m", 0, 0, 100, 200, 16), **fields)


def value(registry: CollectorRegistry, name: str, side: str) -> float:
    return registry.get_sample_value(f"splitserve_scheduler_prefix_{name}_total", {"side": side})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_registry_keeps_each_workers_tier_from_its_kv_events():
    registry = Registry()
    registry.on_heartbeat(beat(kv_tier=TierCounters(capacity_bytes=1 << 30)), now=0.0)
    registry.on_kv_events(KVEvents("w1", 0, stored=[1], tier_stored=[2, 3]))
    registry.on_kv_events(KVEvents("w1", 1, removed=[1], tier_stored=[1], tier_removed=[3]))
    view = registry.views()[0]
    assert (view.cached, view.in_tier) == (set(), {1, 2})
    assert view.tier_weight == UNMEASURED_TIER_WEIGHT
    registry.on_kv_events(KVEvents("w1", 5, stored=[7]))  # a gap: both sets start again
    assert (registry.views()[0].cached, registry.views()[0].in_tier) == ({7}, set())


def test_a_tier_block_is_worth_the_share_of_recompute_that_loading_saves():
    assert tier_weight(beat()) == 0.0  # no tier
    tier = TierCounters(capacity_bytes=1 << 30, hits=10, load_seconds=0.01)  # 1 ms a block
    assert tier_weight(beat(kv_tier=tier)) == UNMEASURED_TIER_WEIGHT  # no prefill rate yet
    # 16 tokens at 4000 tokens/s: 4 ms to recompute a block, 1 ms to load it
    assert tier_weight(beat(kv_tier=tier, prefill_rate=4000.0)) == 0.75
    slow = replace(tier, load_seconds=1.0)  # 100 ms a block: recomputing is cheaper
    assert tier_weight(beat(kv_tier=slow, prefill_rate=4000.0)) == 0.0


def test_predicted_hits_never_cover_the_last_token():
    assert predicted_tokens(4, num_tokens=64, block_size=16) == 48  # token 64 is computed
    assert predicted_tokens(4, num_tokens=65, block_size=16) == 64
    assert predicted_tokens(2, num_tokens=65, block_size=16) == 32
    assert predicted_tokens(0, num_tokens=1, block_size=16) == 0


def test_the_computing_workers_report_is_compared_once():
    registry = CollectorRegistry()
    book = HitBook(registry)
    book.remember("r1", "p0", predicted=48, block_size=16)
    assert book.observe(FirstToken("r1", 0.1, cached_tokens=48), "other") is None
    assert book.observe(FirstToken("r1", 0.1, cached_tokens=32), "p0") == -16
    assert book.observe(FirstToken("r1", 0.1, cached_tokens=32), "p0") is None  # once
    assert value(registry, "predicted_tokens", "compute") == 48
    assert value(registry, "actual_tokens", "compute") == 32
    assert value(registry, "divergences", "compute") is None  # one block off: within bound


def test_divergences_beyond_the_bound_are_counted_and_logged_once_an_interval(caplog):
    registry, clock = CollectorRegistry(), Clock()
    book = HitBook(registry, clock=clock)
    with caplog.at_level(logging.WARNING, logger="services.scheduler.hit_check"):
        assert book.compare("reserve", "r1", "d0", predicted=64, actual=0, block_size=16)
        assert book.compare("reserve", "r2", "d0", predicted=0, actual=48, block_size=16)
        assert not book.compare("reserve", "r3", "d0", predicted=48, actual=32, block_size=16)
        clock.now += LOG_EVERY_S
        assert book.compare("reserve", "r4", "d0", predicted=64, actual=16, block_size=16)
    assert value(registry, "divergences", "reserve") == 3
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "r1" in logged[0] and "r4" in logged[1]
    assert "2 such since the last report" in logged[1]


def test_the_book_forgets_old_predictions():
    clock = Clock()
    book = HitBook(clock=clock)
    book.remember("r1", "p0", predicted=16, block_size=16)
    clock.now += 301.0
    book.remember("r2", "p0", predicted=16, block_size=16)
    book.forget_older(clock.now)
    assert len(book) == 1
    assert book.observe(FirstToken("r1", 0.1, 16), "p0") is None
