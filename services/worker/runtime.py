"""The NATS side of a worker: subscriptions per role (role_change.py, with the role's change
while serving), the engine's events routed to the request table (requests.py), heartbeats,
KV events, deadlines and an ordered shutdown
(stop intake → finish in-flight work within the grace period → fail what is left, so its
gateways migrate it → close the connection → stop the engine). prefill.py and decode.py
hold what each side does with a request; the engine sits behind `EngineClient`.

An engine that dies (a bug in a step) fails every request it held — each gateway migrates
its streams at once — and sets `failed`, on which the process exits non-zero to be restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.worker.adapters import AdapterCommands
from services.worker.config import WorkerConfig
from services.worker.context import WorkerContext
from services.worker.decode import DecodeSide
from services.worker.engine_client import EngineClient
from services.worker.engines import make_engine
from services.worker.heartbeat import worker_heartbeat
from services.worker.peer_share import start_peer_share
from services.worker.prefill import PrefillSide
from services.worker.requests import RECEIVES, RequestState, RequestTable, WorkerRequest
from services.worker.role_change import Intake, RoleChange
from services.worker.sleep import WorkerSleep
from services.worker.startup import StartupReport
from services.worker.telemetry import WorkerTelemetry
from shared.bus import Bus, Headers
from shared.engine.outputs import StepOutput
from shared.engine.startup_phases import StartupPhase
from shared.epoch import new_epoch
from shared.kvtransfer.link import KVLink
from shared.kvtransfer.select import make_transport
from shared.kvtransfer.transfer import TransportFactory
from shared.liveness_messages import Probe, ProbeAck
from shared.protocol import Cancel, KVEvents, Outcome, RequestFailed, WorkerLost
from shared.subjects import Subjects
from shared.telemetry.metrics import serve_metrics

log = logging.getLogger(__name__)
S = RequestState
OUTBOX_FLUSH_S = 1.0  # at shutdown, how long queued chunks (and engine aborts) may take


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        engine: EngineClient | None = None,
        transport_factory: TransportFactory | None = None,
    ) -> None:
        """`transport_factory(name, cache layers, layout, wanted)` makes the one-sided KV
        transport (None: nats only); tests pass one of fake transports. Both default to
        those of the engine `config.engine_kind` names (engines.py)."""
        self._config = config  # until start(): then the context's, which a role change replaces
        if engine is None:
            engine, default_factory = make_engine(config)
        else:
            default_factory = make_transport
        self.engine = engine
        self.transport_factory = transport_factory or default_factory
        self.telemetry = WorkerTelemetry(config)
        self.startup = StartupReport(self.telemetry.metrics.registry)
        self.table = RequestTable(self.telemetry)
        self.failed = asyncio.Event()  # the engine died: the process should exit non-zero
        self.ctx: WorkerContext | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self.role_change: RoleChange | None = None
        self.metrics_port = 0  # bound by start() when config.metrics_port is set
        self.epoch = new_epoch()  # this process's, in every heartbeat and probe answer
        self._seq_no = -1  # of the last KVEvents published
        self._background: list[asyncio.Task[None]] = []

    @property
    def config(self) -> WorkerConfig:
        """This worker's settings, `role` its current one."""
        return self._config if self.ctx is None else self.ctx.config

    async def start(self) -> None:
        """Load the model, connect, subscribe, start heartbeats."""
        config, wid = self.config, self.config.worker_id
        self.startup.imported()
        if config.metrics_port is not None:  # first: a port given at launch stays this one's
            self.metrics_port = serve_metrics(
                self.telemetry.metrics.registry,
                config.metrics_port,
                # /ready: 503 while the model loads, and once SIGTERM starts the drain
                ready=lambda: self.ctx is not None and not self.ctx.draining,
            )
            print(f"worker {wid} metrics on port {self.metrics_port}", flush=True)
        started = time.perf_counter()
        layout = await self.engine.start(self)
        self.startup.engine_started(self.engine.startup_phases(), time.perf_counter() - started)
        with self.startup.clock.timing(StartupPhase.KV_REGISTRATION):
            transport = await asyncio.to_thread(
                self.transport_factory,
                wid,
                self.engine.kv.cache_layers(),
                layout,
                config.kv_transport,
            )
        connecting = time.perf_counter()
        common = config.common
        bus = await Bus.connect(common.nats_url, f"worker-{wid}", auth=common.nats_auth)
        self.telemetry.metrics.registry.register(bus.rejections.counter)
        subjects = Subjects(common.namespace)
        kv = self.engine.kv
        link = KVLink(
            bus,
            wid,
            layout,
            config.kv_window,
            config.kv_headroom,
            kv,
            kv.copier,
            transport,
            self.epoch,
        )
        self.ctx = ctx = WorkerContext(
            config,
            bus,
            subjects,
            self.engine,
            layout,
            self.table,
            self.telemetry,
            asyncio.Queue(),
            link,
        )
        ctx.peer_reads = await start_peer_share(ctx)  # prefix blocks between workers
        self.prefill, self.decode = PrefillSide(ctx), DecodeSide(ctx)  # either may serve
        intake = Intake(ctx, self.prefill, self.decode)
        await intake.serve(config.role)
        self.role_change = RoleChange(ctx, intake, self._beat)
        await self.role_change.start()
        await AdapterCommands(ctx, self._beat).start()
        await bus.serve(subjects.probe(wid), Probe, self._on_probe, _bad_probe)
        await WorkerSleep(ctx, self._beat, self._fail_all).start()
        await bus.subscribe(subjects.events, (RequestFailed, WorkerLost), self._on_event)
        await bus.subscribe(subjects.cancel, Cancel, self._on_cancel)
        self._background.append(asyncio.create_task(self._publish_tokens()))
        self.startup.clock.add(StartupPhase.CONNECT, time.perf_counter() - connecting)
        self.startup.ready()
        self._background.append(asyncio.create_task(self._heartbeats()))
        log.info("worker %s (%s) serving %s", wid, config.role, config.model_name)

    async def shutdown(self) -> None:
        """Stop intake, let in-flight work finish within the grace period, then close.
        Idempotent."""
        ctx = self.ctx
        if ctx is None:
            await self.engine.cleanup()
            return
        if ctx.draining:
            return
        ctx.draining = True
        with contextlib.suppress(Exception):  # a lost connection must not stop the drain
            await self._beat()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.grace_period
        while len(self.table) and loop.time() < give_up:
            await asyncio.sleep(0.05)
        if len(self.table):
            log.warning("grace period over with %d requests in flight", len(self.table))
            hand_offs = [e.hand_off for e in self.table if e.hand_off is not None]
            self._fail_all("the worker is shutting down")
            if hand_offs:  # each tells its gateway, then its decode worker (bounded)
                await asyncio.wait(hand_offs, timeout=OUTBOX_FLUSH_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctx.outbox.join(), timeout=OUTBOX_FLUSH_S)
        for task in self._background:
            task.cancel()
        await ctx.bus.close()
        # The aborts and releases just queued reach the engine before its blocks are
        # deregistered and it stops.
        if not await self.engine.drain(OUTBOX_FLUSH_S):
            log.warning("the engine still held requests at shutdown")
        ctx.link.close()
        await self.engine.cleanup()
        self.telemetry.tracing.shutdown()

    # -- EngineEvents (called on the loop) ------------------------------------------------
    def on_step(self, step: StepOutput, step_started: float) -> None:
        """The engine's transitions, each handled once: started (its queue span ends), a
        prefill's first token (its hand-off starts, with the blocks held), a decode's tokens
        (streamed; its finish ends it). The table moves only where the worker takes over."""
        self.startup.on_step(step_started)
        for request_id in step.started:
            entry = self.table.get(request_id)
            if entry is not None and entry.state == S.ENGINE:
                self.telemetry.on_started(entry, step_started)
        for output in step.outputs:
            entry = self.table.get(output.request_id)
            if entry is None:  # cancelled while the step ran
                continue
            self.telemetry.on_output(entry, output, step_started)
            if entry.decodes:
                assert self.decode is not None
                self.decode.on_output(entry, output)
            elif entry.hand_off is None:  # a prefill's first token
                assert self.prefill is not None
                self.prefill.on_output(entry, output, step.held.get(output.request_id))

    def on_request_failed(self, request_id: str, error: BaseException) -> None:
        log.error("%s: the engine failed it", request_id, exc_info=error)
        entry = self.table.get(request_id)
        if entry is not None:
            self._stop(entry, f"internal error: {error}", tell_gateway=True)

    def on_fatal(self, error: BaseException) -> None:
        log.critical("the engine stopped: %r; failing every request", error)
        self._fail_all(f"internal error: the engine stopped ({error})")
        self.failed.set()

    # -- subscriptions ----------------------------------------------------------------------
    async def _on_probe(self, probe: Probe, headers: Headers) -> ProbeAck:
        """Answered on the loop, whatever the engine is doing: this process is alive."""
        return ProbeAck(self.config.worker_id, self.epoch)

    async def _on_event(self, event: RequestFailed | WorkerLost, headers: Headers) -> None:
        """A `WorkerLost` (its gateways migrate what it names) frees the reservations its
        prefills would have filled, and the prompts computed or held for it as a decode
        worker; a request already decoding here has its whole KV and goes on. One naming
        this worker (it was frozen past the scheduler's probe) drops what it names: those
        requests go on elsewhere, and this worker rejoins with its next heartbeat."""
        if not isinstance(event, WorkerLost):
            return
        own = event.worker_id == self.config.worker_id
        for request_id in event.request_ids:
            entry = self.table.get(request_id)
            if entry is None:
                continue
            if own:
                log.warning("%s: this worker was taken for lost; dropped", request_id)
                self._stop(entry, "this worker was taken for lost", tell_gateway=False)
                continue
            awaits_lost_prefill = entry.state in RECEIVES
            serves_lost_decode = not entry.decodes and entry.decode_worker == event.worker_id
            if awaits_lost_prefill or serves_lost_decode:
                self._stop(entry, "cancelled", tell_gateway=False)

    async def _on_cancel(self, msg: Cancel, headers: Headers) -> None:
        entry = self.table.get(msg.request_id)
        if entry is not None:
            self._stop(entry, "cancelled", tell_gateway=False)

    def _stop(self, entry: WorkerRequest, reason: str, *, tell_gateway: bool) -> None:
        side = self.decode if entry.decodes else self.prefill
        assert side is not None
        side.stop(entry, reason, tell_gateway=tell_gateway)

    def _fail_all(self, reason: str) -> None:
        """Fail every request held here; a gateway whose stream this worker carries (not a
        reservation: its prefill worker carries it) migrates it at once."""
        for entry in self.table:
            carries_stream = entry.state not in RECEIVES
            self._stop(entry, reason, tell_gateway=carries_stream)

    # -- background tasks ---------------------------------------------------------------------
    async def _publish_tokens(self) -> None:
        """Forever: publish queued token chunks in order."""
        assert self.ctx is not None
        outbox = self.ctx.outbox
        while True:
            subject, chunk = await outbox.get()
            try:
                await self.ctx.bus.publish(subject, chunk)
            except Exception:  # a lost connection: the gateway's stall timeout migrates it
                log.exception("%s: token chunk not published", chunk.request_id)
            outbox.task_done()

    async def _heartbeats(self) -> None:
        """At a fixed rate, not `interval` after each beat's work: time the loop spent
        elsewhere is not added to the gap the scheduler sees. A request that ends brings the
        next beat forward (at most one every `interval / 10`): the scheduler counts the
        blocks it placed since the last beat as taken, and a request waiting on that count
        would otherwise wait out the interval while the blocks are already free."""
        loop, interval = asyncio.get_running_loop(), self.config.heartbeat_interval
        next_beat = loop.time()
        while True:
            self.table.ended.clear()  # a request ending from here on is in this beat or the next
            try:
                await self._beat()
                self._expire()
            except Exception:  # a lost connection must not stop the beat
                log.exception("heartbeat failed")
            soonest = loop.time() + interval / 10
            next_beat = max(next_beat + interval, soonest)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.table.ended.wait(), next_beat - loop.time())
                await asyncio.sleep(soonest - loop.time())
                next_beat -= interval  # an extra beat: the regular one stays where it was

    def _expire(self) -> None:
        """Drop reservations whose KV stopped coming; fail work past its deadline (a
        transfer in flight has its own)."""
        assert self.ctx is not None
        now = asyncio.get_running_loop().time()
        for entry in self.table:
            if entry.deadline > now or entry.state == S.TRANSFERRING:
                continue
            self._stop(entry, "deadline", tell_gateway=entry.state not in RECEIVES)

    async def _beat(self) -> None:
        """Publish a Heartbeat, and KVEvents when the prefix cache changed."""
        assert self.ctx is not None
        stats = self.engine.stats()  # counters the engine thread keeps: never waits
        config, bus, subjects = self.config, self.ctx.bus, self.ctx.subjects
        beat = worker_heartbeat(
            config,
            self.ctx,
            stats,
            self.telemetry,
            num_requests=len(self.table),
            metrics_port=self.metrics_port,
            kv_peers=self.prefill.peers.snapshot() if self.prefill is not None else [],
            epoch=self.epoch,
            startup=self.startup,
        )
        await bus.publish(subjects.heartbeat, beat)
        self.telemetry.on_stats(stats)
        events = self.engine.take_kv_events()
        if events:
            self._seq_no += 1
            message = KVEvents(
                config.worker_id,
                self._seq_no,
                events.stored,
                events.removed,
                events.tier_stored,
                events.tier_removed,
            )
            await bus.publish(subjects.kv_events, message)


def _bad_probe(reason: str) -> ProbeAck:
    return ProbeAck("", 0, Outcome.INVALID, reason)
