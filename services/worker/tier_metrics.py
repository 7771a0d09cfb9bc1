"""The second KV tier's counters (shared/engine/kv_tier/) out of the worker: as Prometheus
samples on /metrics (`TierMetrics`) and as the heartbeat's `TierCounters` (/mesh).

Metrics, labelled by `role`, `tier` ("host": the worker's own directory or /dev/shm) and
`model` when the worker names one: splitserve_kv_tier_{hits, refused, skipped, read_bytes,
written_bytes, load_seconds, evictions, prefetched, late, dropped_writes, unwritten}_total
(counters), and
splitserve_kv_tier_{stored_bytes, capacity_bytes, write_stopped} (gauges). The one subtle
rule: they are read at each scrape from the newest stats the heartbeat saw, so a worker
without a tier exports none of them, and counters never move backwards within a process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from shared.engine.kv_tier.tier_stats import TierStats
from shared.kv_tier_messages import TierCounters
from shared.telemetry.metrics import P

TIER = "host"  # the one tier a worker has today
COUNTERS = {  # metric name (without _total) -> (TierStats field, help)
    "hits": ("hits", "KV blocks loaded back from the tier instead of recomputed"),
    "refused": ("refused", "Tier entries refused (checksum, foreign, truncated) and recomputed"),
    "skipped": ("skipped", "KV blocks the tier held but recomputed, since loading cost more"),
    "read_bytes": ("bytes_in", "Bytes read back from the tier"),
    "written_bytes": ("bytes_out", "Bytes written to the tier"),
    "load_seconds": ("load_seconds", "Seconds spent loading blocks from the tier"),
    "evictions": ("evictions", "Tier entries dropped to stay under its size"),
    "prefetched": ("prefetched", "KV blocks loaded from the tier after a read beside a step"),
    "late": ("late", "KV blocks recomputed since their tier read passed its deadline"),
    "dropped_writes": ("dropped_writes", "Evicted KV blocks not written: the writer was behind"),
    "unwritten": ("unwritten", "Evicted KV blocks not written: none was seen to return"),
}
GAUGES = {
    "stored_bytes": ("stored_bytes", "Bytes the tier holds"),
    "capacity_bytes": ("capacity_bytes", "The tier's size limit"),
    "write_stopped": ("write_stopped", "1 when a write failed (full disk) and writing stopped"),
}


def tier_counters(stats: TierStats) -> TierCounters:
    """The heartbeat's copy of the tier's counters."""
    return TierCounters(**dataclasses.asdict(stats))


class TierMetrics(Collector):
    def __init__(self, role: str, model: str = "") -> None:
        self._labels = {"role": role, "tier": TIER} | ({"model": model} if model else {})
        self._stats = TierStats()

    def update(self, stats: TierStats) -> None:
        self._stats = stats  # one reference: a scrape reads one whole snapshot

    def collect(self) -> Iterable[Metric]:
        stats = self._stats
        if stats.capacity_bytes == 0:
            return
        names, values = list(self._labels), list(self._labels.values())
        for name, (field, text) in COUNTERS.items():
            family = CounterMetricFamily(P + "kv_tier_" + name, text, labels=names)
            family.add_metric(values, float(getattr(stats, field)))
            yield family
        for name, (field, text) in GAUGES.items():
            family = GaugeMetricFamily(P + "kv_tier_" + name, text, labels=names)
            family.add_metric(values, float(getattr(stats, field)))
            yield family
