"""The NATS side of a worker: subscriptions per role, heartbeats, KV events, deadlines and
an ordered shutdown (stop intake → finish in-flight work within the grace period → close
the connection → stop the engine thread). See prefill.py and decode.py for the queues a
request passes through on each side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace

from services.worker.config import WorkerConfig
from services.worker.context import WorkerContext
from services.worker.decode import DecodeSide
from services.worker.engine_thread import EngineThread
from services.worker.prefill import PrefillSide
from services.worker.telemetry import WorkerTelemetry
from shared.bus import Bus, Headers
from shared.engine.engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.spec_decode import SpecDecodeStats
from shared.kvtransfer import KVLayout
from shared.kvtransfer.nats_transport import serve_kv
from shared.protocol import (
    Cancel,
    DecodeTask,
    Heartbeat,
    KVEvents,
    PrefillTask,
    RequestFailed,
    Reservation,
    Reserve,
    TaskAck,
    WorkerLost,
)
from shared.subjects import Subjects
from shared.telemetry.metrics import serve_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    block_size: int
    cached: frozenset[int]  # block hashes in the prefix cache
    usage: float  # fraction of KV blocks in use
    prefix_queries: int  # since start, in tokens
    prefix_hits: int
    spec_decode: SpecDecodeStats  # a copy: draft tokens proposed, accepted, verify steps


def engine_stats(engine: LLMEngine) -> EngineStats:
    blocks = engine.block_manager
    return EngineStats(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        free_blocks=blocks.num_free_blocks,
        total_blocks=blocks.num_blocks,
        block_size=blocks.block_size,
        cached=frozenset(blocks.cached),
        usage=blocks.usage,
        prefix_queries=blocks.prefix_queries,
        prefix_hits=blocks.prefix_hits,
        spec_decode=replace(engine.spec_stats),
    )


def kv_layout(engine: LLMEngine) -> KVLayout:
    model = engine.model_config
    return KVLayout(
        num_layers=model.num_layers,
        block_size=engine.config.block_size,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=engine.config.dtype,
    )


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine = EngineThread(config.engine_config(), self._on_outputs, engine_stats)
        self.ctx: WorkerContext | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self._cached: frozenset[int] = frozenset()  # as last announced in KVEvents
        self._seq_no = 0
        self._background: list[asyncio.Task[None]] = []
        self.telemetry = WorkerTelemetry(config)
        self.metrics_port = 0  # bound by start() when config.metrics_port is set
        self._prefix_counted = (0, 0)  # (queries, hits) already added to the counters
        self._spec_counted = SpecDecodeStats()  # already added to the counters

    async def start(self) -> None:
        """Load the model, connect, subscribe, start heartbeats."""
        config = self.config
        await self.engine.start()
        layout = await self.engine.call(kv_layout)
        bus = await Bus.connect(config.nats_url, f"worker-{config.worker_id}")
        subjects = Subjects(config.namespace)
        self.ctx = ctx = WorkerContext(config, bus, subjects, self.engine, layout)
        wid = config.worker_id
        if config.metrics_port is not None:
            self.metrics_port = serve_metrics(
                self.telemetry.metrics.registry,
                config.metrics_port,
                ready=lambda: not ctx.draining,  # /ready: 503 once SIGTERM starts the drain
            )
            print(f"worker {wid} metrics on port {self.metrics_port}", flush=True)
        if config.prefills:
            self.prefill = PrefillSide(ctx, self.telemetry)
            await bus.serve(subjects.prefill(wid), PrefillTask, self.prefill.on_task, _refuse)
        if config.decodes:
            self.decode = decode = DecodeSide(ctx, self.telemetry)
            await bus.serve(subjects.reserve(wid), Reserve, decode.on_reserve, _refuse_reserve)
            await bus.serve(subjects.decode(wid), DecodeTask, decode.on_task, _refuse)
            await serve_kv(bus, subjects.kv(wid), decode.on_chunk, decode.on_done)
            await bus.subscribe(subjects.events, (RequestFailed, WorkerLost), self._on_event)
            self._background.append(asyncio.create_task(decode.publish_tokens()))
        await bus.subscribe(subjects.cancel, Cancel, self._on_cancel)
        self._background.append(asyncio.create_task(self._heartbeats()))
        log.info("worker %s (%s) serving %s", wid, config.role, config.model_name)

    @property
    def busy(self) -> bool:
        return any(side is not None and side.busy for side in (self.prefill, self.decode))

    async def shutdown(self) -> None:
        """Stop intake, let in-flight work finish within the grace period, then close."""
        if self.ctx is None:
            await self.engine.stop()
            return
        self.ctx.draining = True
        await self._beat()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.grace_period
        while self.busy and loop.time() < give_up:
            await asyncio.sleep(0.05)
        if self.busy:
            log.warning("grace period over with work in flight; dropping it")
        if self.decode is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.decode.outbox.join(), timeout=1.0)
        for task in self._background:
            task.cancel()
        if self.prefill is not None:
            for task in list(self.prefill.tasks):
                task.cancel()
        await self.ctx.bus.close()
        await self.engine.stop()
        self.telemetry.tracing.shutdown()

    def _on_outputs(self, outputs: list[RequestOutput], step_started: float) -> None:
        for output in outputs:
            self.telemetry.on_output(output, step_started)
            if self.prefill is not None and output.request_id in self.prefill.computing:
                self.prefill.on_output(output)
            elif self.decode is not None:
                self.decode.on_output(output)

    async def _on_event(self, event: RequestFailed | WorkerLost, headers: Headers) -> None:
        """Scheduler events: a `WorkerLost` frees the reservations its prefills would fill."""
        lost = isinstance(event, WorkerLost) and event.worker_id != self.config.worker_id
        if lost and self.decode is not None:
            await self.decode.on_worker_lost(event.request_ids)

    async def _on_cancel(self, msg: Cancel, headers: dict[str, str]) -> None:
        for side in (self.prefill, self.decode):
            if side is not None:
                await side.cancel(msg.request_id)

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self._beat()
                for side in (self.prefill, self.decode):
                    if side is not None:
                        await side.expire()
            except Exception:  # a lost connection or a failed engine must not stop the beat
                log.exception("heartbeat failed")
            await asyncio.sleep(self.config.heartbeat_interval)

    async def _beat(self) -> None:
        """Publish a Heartbeat, and KVEvents when the prefix cache's hashes changed."""
        assert self.ctx is not None
        stats: EngineStats = self.engine.observed  # never waits for a step in progress
        config, bus, subjects = self.config, self.ctx.bus, self.ctx.subjects
        beat = Heartbeat(
            worker_id=config.worker_id,
            role=config.role,
            model=config.model_name,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            block_size=stats.block_size,
            draining=self.ctx.draining,
            kv_blocks_sent=self.ctx.kv_blocks_sent,
            kv_blocks_received=self.ctx.kv_blocks_received,
            prefix_queries=stats.prefix_queries,
            prefix_hits=stats.prefix_hits,
            spec_proposed_tokens=stats.spec_decode.proposed,
            spec_accepted_tokens=stats.spec_decode.accepted,
            spec_verify_steps=stats.spec_decode.verify_steps,
            metrics_port=self.metrics_port,
        )
        await bus.publish(subjects.heartbeat, beat)
        self._update_gauges(stats)
        if stats.cached != self._cached:
            stored = sorted(stats.cached - self._cached)
            removed = sorted(self._cached - stats.cached)
            self._seq_no += 1
            events = KVEvents(config.worker_id, self._seq_no, stored, removed)
            await bus.publish(subjects.kv_events, events)
            self._cached = stats.cached

    def _update_gauges(self, stats: EngineStats) -> None:
        metrics, role = self.telemetry.metrics, self.config.role
        metrics.running.labels(role).set(stats.num_running)
        metrics.waiting.labels(role).set(stats.num_waiting)
        metrics.kv_usage.labels(role).set(stats.usage)
        queries, hits = self._prefix_counted
        metrics.prefix_queries.labels(role).inc(stats.prefix_queries - queries)
        metrics.prefix_hits.labels(role).inc(stats.prefix_hits - hits)
        self._prefix_counted = (stats.prefix_queries, stats.prefix_hits)
        spec, counted = stats.spec_decode, self._spec_counted
        metrics.spec_proposed.labels(role).inc(spec.proposed - counted.proposed)
        metrics.spec_accepted.labels(role).inc(spec.accepted - counted.accepted)
        metrics.spec_verify_steps.labels(role).inc(spec.verify_steps - counted.verify_steps)
        metrics.spec_acceptance.labels(role).set(spec.acceptance_rate)
        self._spec_counted = spec


def _refuse(reason: str) -> TaskAck:
    return TaskAck("", ok=False, error=reason)


def _refuse_reserve(reason: str) -> Reservation:
    return Reservation("", ok=False, error=reason)
