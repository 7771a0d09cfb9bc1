"""A worker's part in prefix reads between workers (docs/kv_tier.md): `start_peer_share`
starts both sides — `PeerReads` (reads the blocks its tasks' hints name) and `PeerHolder`
(pins its own for others' reads) — and exports their counters on /metrics.

Metrics, labelled `role` (and `model` when the worker names one):
splitserve_kv_peer_read_{blocks,bytes,seconds}_total, splitserve_kv_peer_read_fallbacks_total
{reason} and splitserve_kv_peer_pinned_blocks_total (holder side). The one subtle rule: they
are read at each scrape from the live counters, which only grow.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.worker.context import WorkerContext
from services.worker.peer_holder import PeerHolder
from services.worker.peer_reads import PeerReads
from shared.prefix_messages import PeerFallback, PeerReadCounters
from shared.telemetry.metrics import P

COUNTERS = {  # metric name (without _total) -> (PeerReadCounters field, help)
    "kv_peer_read_blocks": ("blocks", "KV blocks read from other workers' pools"),
    "kv_peer_read_bytes": ("bytes", "Bytes of KV read from other workers' pools"),
    "kv_peer_read_seconds": ("seconds", "Seconds spent reading KV from other workers"),
    "kv_peer_pinned_blocks": ("pinned_for_peers", "KV blocks pinned for other workers' reads"),
}


async def start_peer_share(ctx: WorkerContext) -> PeerReads:
    config, kv = ctx.config, ctx.engine.kv
    reads = PeerReads(
        ctx.bus,
        ctx.subjects,
        ctx.link,
        kv.peer_blocks,
        config.kv_peer_read_timeout,
        lambda: ctx.engine.stats().costs.prefill_rate,
    )
    await PeerHolder(ctx.link, kv.peer_blocks, reads.counters).start(ctx.bus, ctx.subjects)
    labels = {"role": config.role} | ({"model": config.model_name} if config.model_name else {})
    ctx.telemetry.metrics.registry.register(PeerReadMetrics(reads.counters, labels))
    return reads


class PeerReadMetrics(Collector):
    def __init__(self, counters: PeerReadCounters, labels: dict[str, str]) -> None:
        self._counters = counters
        self._labels = labels

    def collect(self) -> Iterable[Metric]:
        counters = self._counters
        names, values = list(self._labels), list(self._labels.values())
        for name, (field, text) in COUNTERS.items():
            family = CounterMetricFamily(P + name, text, labels=names)
            family.add_metric(values, float(getattr(counters, field)))
            yield family
        text = "Hinted prefix reads not made or not used (computed instead), by reason"
        family = CounterMetricFamily(P + "kv_peer_read_fallbacks", text, labels=[*names, "reason"])
        for reason in PeerFallback:
            family.add_metric([*values, reason.name.lower()], float(counters.fallbacks[reason]))
        yield family
