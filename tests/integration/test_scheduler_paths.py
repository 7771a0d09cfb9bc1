"""The path chosen per request over a real nats-server (fake workers that report measured
costs): the predicted TTFT in the ack and on the `scheduler.route` span, and when a worker's
heartbeat reports the first token, the prediction error in
`splitserve_scheduler_ttft_prediction_error_seconds{path}` and a `scheduler.first_token`
span under the route span."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import asynccontextmanager

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler.config import SchedulerConfig
from services.scheduler.predictions import PredictionBook
from services.scheduler.service import SchedulerService
from shared.bus import Bus
from shared.config import CommonConfig
from shared.protocol import DecodeTask, FirstToken, Heartbeat, KVPeer, Reserve, SubmitRequest
from shared.subjects import Subjects
from shared.telemetry.tracing import Tracing
from tests.integration.scheduler_harness import FakeWorker, place, status, submit, until

RATE = 2000.0
BLOCK_BYTES = 600_000
LINK = KVPeer("d1", "nixl", 640, 10, mean_bytes=40 * BLOCK_BYTES, mean_seconds=0.02, latency=0.002)


@dataclasses.dataclass
class MeasuredWorker(FakeWorker):
    """A fake worker whose heartbeats carry measured costs and the first tokens it streamed."""

    running: int = 0
    queued: int = 0  # prompt tokens it has yet to compute
    stall_s: float = 0.0  # what its streams waited on prompt work lately
    peers: list[KVPeer] = dataclasses.field(default_factory=list)
    first_tokens: list[FirstToken] = dataclasses.field(default_factory=list)

    async def beat(self) -> None:
        self.room = self.room_per_beat
        heartbeat = Heartbeat(
            self.worker_id, self.role, "m", self.running, 0, self.free_blocks, 200, 16,
            prefill_rate=RATE, decode_step_s=0.02, block_bytes=BLOCK_BYTES,
            kv_peers=self.peers, first_tokens=self.first_tokens,
            queued_prompt_tokens=self.queued, stall_s=self.stall_s,
        )  # fmt: skip
        self.first_tokens = []
        await self.bus.publish(self.subjects.heartbeat, heartbeat)


@asynccontextmanager
async def scheduler(
    url: str, namespace: str, workers: list[FakeWorker], exporter: object, **config_fields: str
):
    """A scheduler whose spans go to `exporter`, and the workers; yields (service, client)."""
    common = CommonConfig(url, namespace)
    fields = {"path_choice": "cost"} | config_fields
    config = SchedulerConfig(common=common, heartbeat_timeout=1.0, sweep_interval=0.1, **fields)
    bus = await Bus.connect(url, "scheduler")
    service = SchedulerService(config, bus)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # type: ignore[arg-type]
    service.tracing = Tracing(provider.get_tracer("test"), provider)
    service.predictions = PredictionBook(service.tracing.tracer, service.metrics.ttft_error)
    await service.start()
    workers_bus = await Bus.connect(url, "workers")
    client = await Bus.connect(url, "client")
    for worker in workers:
        await worker.start(workers_bus, Subjects(namespace))
    deadline = time.monotonic() + 5
    while len((await status(client, Subjects(namespace))).workers) < len(workers):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    try:
        yield service, client
    finally:
        for worker in workers:
            worker.beating = False
            worker._beats.cancel()
        await service.stop()
        for each in (client, workers_bus, bus):
            await each.close()


def error_samples(service: SchedulerService, path: str, le: str = "+Inf") -> float:
    """The prediction errors for `path` at most `le` seconds (the histogram's bucket)."""
    name = "splitserve_scheduler_ttft_prediction_error_seconds_bucket"
    labels = {"path": path, "le": le}
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


def timed(request_id: str) -> SubmitRequest:
    request = submit(request_id, list(range(100, 740)))  # 640 tokens: 40 blocks
    request.submitted_at = time.time()
    return request


def spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


@pytest.mark.parametrize(
    ("running", "path"), [(0, "decode_only"), (60, "disaggregated")], ids=["idle", "loaded"]
)
def test_prediction_and_its_error_when_the_first_token_is_reported(nats_server, running, path):
    async def scenario() -> None:
        exporter = InMemorySpanExporter()
        d1 = MeasuredWorker("d1", "decode", running=running)
        p1 = MeasuredWorker("p1", "prefill", peers=[LINK])
        namespace = f"paths{running}"
        async with scheduler(nats_server.url, namespace, [d1, p1], exporter) as (service, client):
            ack = await place(client, namespace, timed("r1"))
            assert ack.accepted
            assert (ack.prefill_worker == "p1") == (path == "disaggregated")
            expected = DecodeTask if path == "decode_only" else Reserve
            assert isinstance(d1.received[-1], expected)
            assert ack.predicted_ttft >= 640 / RATE  # at least the prompt's compute
            (route,) = spans(exporter, "scheduler.route")
            assert route.attributes is not None
            assert route.attributes["splitserve.path"] == path
            assert route.attributes["splitserve.path_rule"] == "cost"
            assert route.attributes["splitserve.predicted_ttft_s"] == ack.predicted_ttft

            observed = ack.predicted_ttft + 0.25
            streamer = p1 if path == "disaggregated" else d1
            streamer.first_tokens = [FirstToken("r1", observed), FirstToken("elsewhere", 1.0)]
            await until(lambda: error_samples(service, path) == 1)
            assert (error_samples(service, path, "0.2"), error_samples(service, path, "0.3")) == (
                0,
                1,
            )
            await until(lambda: bool(spans(exporter, "scheduler.first_token")))
            (first,) = spans(exporter, "scheduler.first_token")
            assert first.parent is not None
            assert first.parent.span_id == route.context.span_id
            assert first.context.trace_id == route.context.trace_id
            assert first.attributes is not None
            assert first.attributes["splitserve.observed_ttft_s"] == pytest.approx(observed)
            assert first.attributes["splitserve.worker"] == streamer.worker_id
            # reported again (a duplicate heartbeat): counted once
            streamer.first_tokens = [FirstToken("r1", observed)]
            await asyncio.sleep(0.5)
            assert error_samples(service, path) == 1

    asyncio.run(scenario())


def test_an_untimed_submit_is_placed_without_keeping_a_prediction(nats_server):
    async def scenario() -> None:
        exporter = InMemorySpanExporter()
        d1 = MeasuredWorker("d1", "decode")
        p1 = MeasuredWorker("p1", "prefill", peers=[LINK])
        async with scheduler(nats_server.url, "untimed", [d1, p1], exporter) as (service, client):
            ack = await place(client, "untimed", submit("r1"))  # submitted_at 0
            assert ack.accepted and ack.predicted_ttft > 0
            assert len(service.predictions) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(("stall_s", "path"), [(0.0, "decode_only"), (3.0, "disaggregated")])
def test_the_slo_choice_reads_the_stall_a_decode_worker_reports(nats_server, stall_s, path):
    """p1 is 2000 tokens behind (1.3 s): only a local prefill keeps the 1 s TTFT, and it does
    while d1's streams can absorb the stall (20 + 320 / 127 ms); after 3 s of stalls lately
    they cannot (20 + 3320 / 127 ms > 40), so the request splits: the streams keep theirs."""

    async def scenario() -> None:
        d1 = MeasuredWorker("d1", "decode", running=4, stall_s=stall_s)
        p1 = MeasuredWorker("p1", "prefill", queued=2000, peers=[LINK])
        namespace = f"slo{int(stall_s)}"
        objectives = {"path_choice": "slo", "path_slo": "ttft=1s,tpot=40ms"}
        workers = [d1, p1]
        async with scheduler(
            nats_server.url, namespace, workers, InMemorySpanExporter(), **objectives
        ) as (_, client):
            request = timed("r1")
            request.sampling = dataclasses.replace(request.sampling, max_tokens=128)
            ack = await place(client, namespace, request)
            assert ack.accepted
            assert (ack.prefill_worker == "p1") == (path == "disaggregated")

    asyncio.run(scenario())
