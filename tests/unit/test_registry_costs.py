"""The registry folds each heartbeat's measurements into what the path choice reads: a
worker's rate, step time and queued prompt tokens (plus those placed since), and each
pair's link, with the fixed cost taken out of the bandwidth."""

from __future__ import annotations

import pytest

from services.scheduler.measures import link_of
from services.scheduler.registry import Registry
from shared.protocol import Heartbeat, KVPeer


def beat(queued: int = 0, peers: list[KVPeer] | None = None, rate: float = 2000.0) -> Heartbeat:
    return Heartbeat(
        "p1", "prefill", "m", 2, 1, 100, 200, 16,
        prefill_rate=rate, decode_step_s=0.02, decode_batch=3.0, queued_prompt_tokens=queued,
        busy=0.5, block_bytes=1000, kv_peers=peers or [],
    )  # fmt: skip


def test_a_heartbeat_s_measures_reach_the_view():
    registry = Registry()
    registry.on_heartbeat(beat(queued=300), now=0.0)
    costs = registry.views()[0].costs
    assert (costs.prefill_rate, costs.decode_step_s) == (2000.0, 0.02)
    assert (costs.queued_tokens, costs.streams, costs.block_bytes) == (300, 2, 1000)
    assert costs.links == {}


def test_placements_count_as_queued_work_until_the_next_heartbeat():
    registry = Registry()
    registry.on_heartbeat(beat(queued=300), now=0.0)
    registry.assign("p1", "r1", deadline=100.0, num_tokens=0, prompt_tokens=500)
    registry.assign("p1", "r2", deadline=100.0, num_tokens=0, prompt_tokens=40)
    costs = registry.views()[0].costs
    assert (costs.queued_tokens, costs.streams) == (840, 4)
    registry.on_heartbeat(beat(queued=520, rate=2500.0), now=1.0)
    costs = registry.views()[0].costs
    assert (costs.queued_tokens, costs.streams, costs.prefill_rate) == (520, 2, 2500.0)


def test_links_per_pair_from_the_transfers():
    fast = KVPeer("d1", "nixl", 100, 10, mean_bytes=1e6, mean_seconds=0.012, latency=0.002)
    unused = KVPeer("d2", "nixl", 0, 0)
    registry = Registry()
    registry.on_heartbeat(beat(peers=[fast, unused]), now=0.0)
    links = registry.views()[0].costs.links
    assert set(links) == {"d1"}
    assert links["d1"].latency == pytest.approx(0.002)
    assert links["d1"].per_byte == pytest.approx(0.010 / 1e6)  # the fixed cost taken out
    slower = KVPeer("d1", "nats", 200, 20, mean_bytes=1e6, mean_seconds=0.102, latency=0.002)
    registry.on_heartbeat(beat(peers=[slower]), now=1.0)
    assert registry.views()[0].costs.links["d1"].per_byte == pytest.approx(0.1 / 1e6)


def test_a_link_without_small_transfers_counts_its_fixed_cost_in_the_bandwidth():
    link = link_of(KVPeer("d1", "nixl", 100, 10, mean_bytes=1e6, mean_seconds=0.012))
    assert link is not None
    assert (link.latency, link.per_byte) == (0.0, pytest.approx(0.012 / 1e6))
    empty = link_of(KVPeer("d1", "nixl", 0, 3, mean_bytes=0.0, mean_seconds=0.004, latency=0.004))
    assert empty is not None
    assert (empty.latency, empty.per_byte) == (0.004, 0.0)
