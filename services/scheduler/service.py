"""The scheduler on NATS: admission and placement of `SubmitRequest`s, status, worker loss.

Subscriptions: submit (queue group, so replicas share the load), status, heartbeats, KV
events, cancels. A sweeper probes silent workers (liveness.py) and publishes `WorkerLost`,
with the request ids placed on each, for those its probe finds lost; it forgets placements
past their deadline, and wakes the waiting line.

Admission, per model (the request's `model`; "" for a one-model mesh): at most `max_queue`
submits of one model are placed or waiting at once; beyond that a submit is refused at once
(BUSY, 429 at the gateway). Beyond `shed_share` of that, so is one that would wait behind
every waiting one (by priority, then its tenant's share: waiting.py, fair_share.py). Every
admitted one is placed or answered by min(its deadline, arrival + `queue_timeout`). A
request whose gateway has a fallback (`has_fallback`) for a model with no worker registered
is refused at once (UNAVAILABLE), so the gateway falls back without waiting; without one it
waits for a worker of its model to join, as any request does.

One try at placing a request (services/scheduler/placement.py, whose docstring gives the
order it asks workers in) places it on a decode worker, with a prefill worker unless it
prefills itself (as it does once a hand-off of its KV failed: hand_offs.py), or finds no
room: no candidate in the registry, or every one asked answered BUSY, UNAVAILABLE, FAILED
or not at all (a worker found lost by the sweeper at once).
An INVALID answer from any worker ends placement at once: the request is refused INVALID
(400 at the gateway) and its reservation freed. No room is not a refusal: the request waits
in its model's line (services/scheduler/waiting.py) and tries again when its turn comes, oldest
first, until it is placed, cancelled, or its give-up time passes (UNAVAILABLE, 503, with
retry_after and the last reason). A submit that arrives while others wait queues behind them.

Each placement's path and predicted TTFT go on its `scheduler.route` span and in its ack;
the observed TTFT comes back in a worker's heartbeat and is compared (predictions.py), as is
the prefix hit the computing worker found against the one predicted (hit_check.py).
The planner's newest report (planner.report) rides along in the status, for /mesh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from opentelemetry.trace import SpanKind

from services.scheduler.adapters import AdapterFanOut, count_placement
from services.scheduler.adapters import refuse as refuse_adapters
from services.scheduler.config import SchedulerConfig
from services.scheduler.hand_offs import HandOffs
from services.scheduler.hit_check import HitBook
from services.scheduler.liveness import Liveness
from services.scheduler.placement import RELEASED, BadSubmit, Placer
from services.scheduler.predictions import PredictionBook
from services.scheduler.registry import Registry, WorkerState
from services.scheduler.route_span import record_route
from services.scheduler.waiting import ModelLines, WaitEnd, Waiter, WaitingLine
from shared.bus import Bus, Headers
from shared.lora_messages import AdapterCommand
from shared.planner_messages import PlannerReport
from shared.protocol import (
    Cancel,
    Heartbeat,
    KVEvents,
    MeshStatus,
    Outcome,
    StatusQuery,
    SubmitAck,
    SubmitRequest,
    WorkerLost,
)
from shared.subjects import SCHEDULER_QUEUE_GROUP, Subjects
from shared.telemetry.metrics import SchedulerMetrics
from shared.telemetry.tracing import extract, inject, setup_tracing

log = logging.getLogger(__name__)

CANCEL_MEMORY_S = 120.0  # how long a Cancel stops a placement still in progress


class SchedulerService:
    def __init__(
        self, config: SchedulerConfig, bus: Bus, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        self.bus = bus
        self.clock = clock
        self.subjects = Subjects(config.common.namespace)
        self.registry = Registry(config.heartbeat_timeout, config.block_size)
        self.placing: dict[str, int] = {}  # model -> submits being placed or waiting now
        self.admitted = 0
        self.rejected = 0
        self.tracing = setup_tracing("scheduler", config.common.otlp_endpoint)
        self.metrics = SchedulerMetrics()
        self.lines = ModelLines()
        self._sweeper: asyncio.Task[None] | None = None
        # Request ids cancelled lately (id -> when): a placement still in progress for one
        # stops instead of starting work nobody will read (the gateway migrated it).
        self.cancelled: dict[str, float] = {}
        self.hits = HitBook(self.metrics.registry, self.tracing.tracer, clock=clock)
        self.hand_offs = HandOffs(self.registry, clock, self.metrics.kv_fallbacks)
        self.placer = Placer(
            config, bus, self.registry, clock, self._is_cancelled, self.hits, self.hand_offs
        )
        self.predictions = PredictionBook(self.tracing.tracer, self.metrics.ttft_error)
        self.planner_report: PlannerReport | None = None  # the newest (services/planner/)
        self.liveness = Liveness(
            bus, self.subjects, self.registry, config.probe_timeout, self._worker_lost
        )

    async def start(self) -> None:
        s = self.subjects
        await self.bus.subscribe(s.heartbeat, Heartbeat, self._on_heartbeat)
        await self.bus.subscribe(s.kv_events, KVEvents, self._on_kv_events)
        await self.bus.subscribe(s.cancel, Cancel, self._on_cancel)
        await self.bus.subscribe(s.planner_report, PlannerReport, self._on_planner_report)
        # A placement waits on workers: each submit is answered in its own task.
        await self.bus.serve(
            s.submit,
            SubmitRequest,
            self.on_submit,
            _bad_submit,
            queue=SCHEDULER_QUEUE_GROUP,
            concurrent=True,
        )
        await self.bus.serve(s.status, StatusQuery, self.on_status, _bad_status)
        fan_out = AdapterFanOut(self.bus, self.registry, s)
        await self.bus.serve(
            s.adapters,
            AdapterCommand,
            fan_out.on_command,
            refuse_adapters,
            queue=SCHEDULER_QUEUE_GROUP,
            concurrent=True,
        )
        await self.bus.nc.flush()
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        """Stop the sweeper and end every wait (answered UNAVAILABLE, so the gateway retries
        another replica); placements in progress finish while the bus drains."""
        self.lines.close()
        await self.liveness.stop()
        if self._sweeper:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    def _is_cancelled(self, request_id: str) -> bool:
        return request_id in self.cancelled

    def on_reconnect(self) -> None:
        self.registry.touch_all(self.clock())

    # -- subscriptions ------------------------------------------------------------------
    async def _on_heartbeat(self, heartbeat: Heartbeat, headers: Headers) -> None:
        if (old := self.registry.replaced(heartbeat)) is not None:
            why = f"restarted: process epoch {heartbeat.epoch} replaced epoch {old.epoch}"
            await self._worker_lost(old, why)
        if heartbeat.worker_id not in self.registry:
            log.info("worker %s joined (role %s)", heartbeat.worker_id, heartbeat.role)
        if self.registry.on_heartbeat(heartbeat, self.clock()):
            self.lines.wake()
        for first in heartbeat.first_tokens:
            self.predictions.observe(first, heartbeat.worker_id)
            self.hits.observe(first, heartbeat.worker_id)

    async def _on_kv_events(self, events: KVEvents, headers: Headers) -> None:
        self.registry.on_kv_events(events)

    async def _on_cancel(self, cancel: Cancel, headers: Headers) -> None:
        if cancel.reason == RELEASED:
            return
        self.registry.forget(cancel.request_id)
        self.cancelled[cancel.request_id] = self.clock()
        self.lines.cancel(cancel.request_id)

    async def _on_planner_report(self, report: PlannerReport, headers: Headers) -> None:
        last = self.planner_report
        if last is None or last.planner_id != report.planner_id or report.seq_no > last.seq_no:
            self.planner_report = report

    async def on_status(self, query: StatusQuery, headers: Headers) -> MeshStatus:
        placing = sum(self.placing.values())
        return MeshStatus(
            self.registry.status(), placing, self.admitted, self.rejected, self.planner_report
        )

    async def sweep(self) -> None:
        now = self.clock()
        self._count_workers()
        self.liveness.sweep(now)
        self.registry.forget_past_deadline(now)
        self.predictions.forget_older(now)
        self.hits.forget_older(now)
        self.hand_offs.forget_older(now)
        horizon = now - CANCEL_MEMORY_S
        self.cancelled = {r: t for r, t in self.cancelled.items() if t > horizon}
        self.lines.wake(backoff=True)  # waiters try again at least once a sweep

    async def _worker_lost(self, state: WorkerState, why: str) -> None:
        worker_id, lost = state.heartbeat.worker_id, sorted(state.assigned)
        log.warning("worker %s lost (%s); %d requests on it", worker_id, why, len(lost))
        self.placer.worker_lost(worker_id)
        await self.bus.publish(self.subjects.events, WorkerLost(worker_id, lost))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            try:
                await self.sweep()
            except Exception:
                log.exception("sweep failed")

    def _count_workers(self) -> None:
        self.metrics.workers.clear()
        for status in self.registry.status():
            beat = status.heartbeat
            state = "draining" if beat.draining else "ready"
            self.metrics.workers.labels(beat.model, beat.role, state).inc()

    # -- admission and waiting ----------------------------------------------------------
    async def on_submit(self, request: SubmitRequest, headers: Headers) -> SubmitAck:
        with self.tracing.tracer.start_as_current_span(
            "scheduler.route", extract(headers), kind=SpanKind.SERVER
        ) as span:
            span.set_attribute("splitserve.request_id", request.request_id)
            span.set_attribute("gen_ai.request.model", request.model)
            ack = await self._admit(request, inject(span))
            count_placement(self.registry, self.metrics, request, ack)
            record_route(span, request, ack, self.predictions, self.clock())
        path = "disaggregated" if ack.prefill_worker else "decode_only" if ack.accepted else ""
        self.metrics.placements.labels(request.model, _outcome_label(ack), path).inc()
        return ack

    async def _admit(self, request: SubmitRequest, headers: Headers) -> SubmitAck:
        model = request.model
        placing = self.placing.get(model, 0)
        if placing >= self.config.max_queue:
            self.rejected += 1
            of_model = f" of model {model}" if model else ""
            error = f"scheduler busy: {placing} requests{of_model} already waiting to be placed"
            return self._refuse(request, Outcome.BUSY, error)
        line = self.lines.of(model)
        if placing >= self.config.shed_share * self.config.max_queue and line.sorts_last(
            request.priority, request.tenant
        ):
            self.rejected += 1
            error = f"scheduler overloaded: {placing} requests waiting would all go first"
            return self._refuse(request, Outcome.BUSY, error)
        if request.has_fallback and not self.registry.serves(model):
            self.rejected += 1
            error = f"no worker of model {model or '(any)'} is registered"
            return self._refuse(request, Outcome.UNAVAILABLE, error)
        self._count_placing(model, +1)
        try:
            ack = await self._place(request, headers)
        except BadSubmit as exc:
            await self.bus.publish(  # frees a reservation already taken
                self.subjects.cancel, Cancel(request.request_id, "invalid"), headers=headers
            )
            ack = SubmitAck(request.request_id, Outcome.INVALID, str(exc))
        finally:
            self._count_placing(model, -1)
        if ack.accepted:
            self.admitted += 1
            tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
            self.lines.fair.charge(request.tenant, tokens)
            self.metrics.tenant_tokens.labels(request.tenant or "none").inc(tokens)
        else:
            self.rejected += 1
        return ack

    def _count_placing(self, model: str, change: int) -> None:
        self.placing[model] = self.placing.get(model, 0) + change
        if not self.placing[model]:
            del self.placing[model]
        self.metrics.waiting.set(sum(self.placing.values()))

    async def _place(self, request: SubmitRequest, headers: Headers) -> SubmitAck:
        """Try at once (unless others wait already); while no worker has room, wait in
        the line for a turn to try again, until placed, cancelled or the give-up time."""
        now = self.clock()
        if request.deadline <= now:
            return SubmitAck(request.request_id, Outcome.UNAVAILABLE, "deadline already passed")
        give_up = min(request.deadline, now + self.config.queue_timeout)
        waiter = Waiter(request.request_id, now, give_up, request.tenant, request.priority)
        line = self.lines.of(request.model)
        if len(line):  # others wait for room already: behind them
            line.join(waiter)
        try:
            ack = await self._try_until_placed(request, waiter, line, headers)
        finally:
            line.leave(waiter)
        self.metrics.tenant_wait.labels(request.tenant or "none").observe(self.clock() - now)
        if waiter.queued:
            self.metrics.queue_wait.labels(_outcome_label(ack)).observe(self.clock() - now)
        return ack

    async def _try_until_placed(
        self, request: SubmitRequest, waiter: Waiter, line: WaitingLine, headers: Headers
    ) -> SubmitAck:
        request_id = request.request_id
        while True:
            end = WaitEnd.TURN
            if waiter in line:
                end = await line.wait(waiter, waiter.give_up - self.clock())
            if line.closed:
                return self._refuse(request, Outcome.UNAVAILABLE, "the scheduler is stopping")
            if end is WaitEnd.CANCELLED or self._is_cancelled(request_id):
                return SubmitAck(request_id, Outcome.UNAVAILABLE, "cancelled while being placed")
            if end is WaitEnd.TIMED_OUT:
                return self._gave_up(request, waiter)
            result = await self.placer.place(request, headers, waiter.give_up)
            if isinstance(result, SubmitAck):
                return result
            if self.clock() < waiter.give_up:  # else the give-up time cut the try short
                waiter.reason = result.reason
            if waiter in line:
                line.tried(waiter, result.asked)
            else:
                log.info("%s waits for room: %s", request_id, result.reason)
                line.join(waiter)

    def _gave_up(self, request: SubmitRequest, waiter: Waiter) -> SubmitAck:
        waited = self.clock() - waiter.arrival
        if waiter.give_up >= request.deadline:
            error = f"the request's deadline passed while it waited: {waiter.reason}"
        else:
            error = f"no worker had room for {waited:.0f} s: {waiter.reason}"
        return self._refuse(request, Outcome.UNAVAILABLE, error)

    def _refuse(self, request: SubmitRequest, outcome: Outcome, error: str) -> SubmitAck:
        log.info("%s refused (%s): %s", request.request_id, outcome.name, error)
        return SubmitAck(request.request_id, outcome, error, retry_after=self.config.retry_after)


def _outcome_label(ack: SubmitAck) -> str:
    return "accepted" if ack.accepted else ack.outcome.name.lower()


def _bad_submit(reason: str) -> SubmitAck:
    return SubmitAck("", Outcome.FAILED, f"bad SubmitRequest: {reason}")


def _bad_status(reason: str) -> MeshStatus:
    return MeshStatus([], 0, 0, 0)
