"""Predicted against actual prefix hits over a real nats-server (fake workers): a prefill
worker whose second KV tier holds the prompt wins it, weighed by its tier's worth; the route
span shows the predicted hit and the decode worker's reservation; a reservation that holds
less than predicted is a divergence in the metric; the computing worker's report of its hit
is compared in a `scheduler.prefix_hit` span under the route span."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler.service import SchedulerService
from shared.engine.block_hash import hash_full_blocks
from shared.kv_tier_messages import TierCounters
from shared.protocol import FirstToken, Heartbeat, KVEvents
from tests.integration.scheduler_harness import place, submit, until
from tests.integration.test_scheduler_paths import (
    BLOCK_BYTES,
    LINK,
    RATE,
    MeasuredWorker,
    scheduler,
    spans,
)

PROMPT = list(range(100, 740))  # 640 tokens: 40 blocks
HASHES = hash_full_blocks(PROMPT, 16, "m")


@dataclasses.dataclass
class TieredWorker(MeasuredWorker):
    """A measured fake worker with a second KV tier holding `in_tier`."""

    in_tier: list[int] = dataclasses.field(default_factory=list)

    async def start(self, bus, subjects) -> None:
        await super().start(bus, subjects)
        events = KVEvents(self.worker_id, 1, tier_stored=self.in_tier)
        await bus.publish(subjects.kv_events, events)

    async def beat(self) -> None:
        self.room = self.room_per_beat
        heartbeat = Heartbeat(
            self.worker_id, self.role, "m", self.running, 0, self.free_blocks, 200, 16,
            prefill_rate=RATE, decode_step_s=0.02, block_bytes=BLOCK_BYTES,
            kv_peers=self.peers, first_tokens=self.first_tokens,
            kv_tier=TierCounters(capacity_bytes=1 << 30),
        )  # fmt: skip
        self.first_tokens = []
        await self.bus.publish(self.subjects.heartbeat, heartbeat)


def hit_sample(service: SchedulerService, name: str, side: str) -> float:
    labels = {"side": side}
    value = service.metrics.registry.get_sample_value(
        f"splitserve_scheduler_prefix_{name}_total", labels
    )
    return value or 0.0


def test_predicted_and_actual_prefix_hits(nats_server):
    async def scenario() -> None:
        exporter = InMemorySpanExporter()
        d1 = TieredWorker("d1", "decode", cached=HASHES[:2], running=60, num_cached_blocks=0)
        plain = TieredWorker("p1", "prefill", peers=[LINK])  # wins ties: its id comes first
        tiered = TieredWorker("p2", "prefill", peers=[LINK], in_tier=HASHES)
        workers = [d1, plain, tiered]
        async with scheduler(nats_server.url, "hits", workers, exporter) as (service, client):
            service.hits.tracer = service.tracing.tracer  # the test's exporter
            await until(lambda: any(v.in_tier for v in service.registry.views()))
            request = submit("r1", PROMPT)
            request.submitted_at = time.time()
            ack = await place(client, "hits", request)
            assert (ack.prefill_worker, ack.decode_worker) == ("p2", "d1")
            (route,) = spans(exporter, "scheduler.route")
            assert route.attributes is not None
            assert route.attributes["splitserve.prefix_predicted_blocks"] == 40
            assert route.attributes["splitserve.prefix_tier_blocks"] == 40
            assert route.attributes["splitserve.reserve_cached_blocks"] == 0
            # d1 was predicted to hold 2 blocks and reserved with none: a divergence
            assert hit_sample(service, "predicted_tokens", "reserve") == 32
            assert hit_sample(service, "actual_tokens", "reserve") == 0
            assert hit_sample(service, "divergences", "reserve") == 1

            tiered.first_tokens = [FirstToken("r1", 0.5, cached_tokens=624)]
            await until(lambda: hit_sample(service, "actual_tokens", "compute") == 624)
            assert hit_sample(service, "predicted_tokens", "compute") == 624
            assert hit_sample(service, "divergences", "compute") == 0
            (hit,) = spans(exporter, "scheduler.prefix_hit")
            assert hit.parent is not None and hit.parent.span_id == route.context.span_id
            assert hit.attributes is not None
            assert hit.attributes["splitserve.prefix_predicted_tokens"] == 624
            assert hit.attributes["splitserve.prefix_actual_tokens"] == 624

    asyncio.run(scenario())
