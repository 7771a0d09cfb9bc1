"""The second KV tier's counters out of a worker: Prometheus samples (none without a tier)
and the heartbeat's copy, which must keep every counter the engine reports."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest

from services.worker.tier_metrics import TierMetrics, tier_counters
from shared.engine.kv_tier.tier_stats import TierStats
from shared.kv_tier_messages import TierCounters
from shared.protocol import Heartbeat, decode, encode

STATS = TierStats(hits=3, bytes_in=300, bytes_out=900, load_seconds=0.25, dropped_writes=2)
STATS = dataclasses.replace(STATS, capacity_bytes=1 << 20, stored_bytes=900, evictions=1)


def scrape(stats: TierStats, model: str = "") -> str:
    registry = CollectorRegistry()
    metrics = TierMetrics("decode", model)
    registry.register(metrics)
    metrics.update(stats)
    return generate_latest(registry).decode()


def test_a_worker_without_a_tier_exports_no_tier_metrics():
    assert "kv_tier" not in scrape(TierStats())


def test_the_tiers_counters_are_exported_by_role_tier_and_model():
    text = scrape(STATS, model="m")
    labels = 'model="m",role="decode",tier="host"'
    for line in (
        f"splitserve_kv_tier_hits_total{{{labels}}} 3.0",
        f"splitserve_kv_tier_read_bytes_total{{{labels}}} 300.0",
        f"splitserve_kv_tier_written_bytes_total{{{labels}}} 900.0",
        f"splitserve_kv_tier_load_seconds_total{{{labels}}} 0.25",
        f"splitserve_kv_tier_evictions_total{{{labels}}} 1.0",
        f"splitserve_kv_tier_dropped_writes_total{{{labels}}} 2.0",
        f"splitserve_kv_tier_stored_bytes{{{labels}}} 900.0",
        f"splitserve_kv_tier_write_stopped{{{labels}}} 0.0",
    ):
        assert line in text, line


def test_the_heartbeat_carries_every_counter_of_the_tier():
    stat_fields = {f.name for f in dataclasses.fields(TierStats)}
    assert {f.name for f in dataclasses.fields(TierCounters)} == stat_fields
    beat = Heartbeat("w1", "decode", "m", 0, 0, 10, 10, 16, kv_tier=tier_counters(STATS))
    sent = decode(encode(beat), Heartbeat).kv_tier
    assert dataclasses.asdict(sent) == dataclasses.asdict(STATS)
