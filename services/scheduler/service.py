"""The scheduler on NATS: admission and placement of `SubmitRequest`s, status, worker loss.

Subscriptions: submit (queue group, so replicas share the load), status, heartbeats, KV
events, cancels. A sweeper expires silent workers, publishing `WorkerLost` with the request
ids placed on each, and forgets placements past their deadline.

Placement of one request (every NATS request bounded by `reserve_timeout` and the deadline,
and given up at once when the sweeper finds the worker it waits on lost):
  decode candidates, best first →
    few uncached tokens or no prefill pool: DecodeTask → accepted (decode only)
    else Reserve → not ok: next decode candidate
         PrefillTask to each prefill candidate in turn → accepted (prefill, decode)
         none took it: Cancel (frees the reservation) → refused
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from nats.errors import Error as NatsError
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from services.scheduler.config import SchedulerConfig
from services.scheduler.registry import Registry
from services.scheduler.routing import (
    Candidate,
    prefills_locally,
    rank_decode,
    rank_prefill,
)
from shared.bus import Bus, Headers
from shared.engine.block_hash import hash_full_blocks
from shared.protocol import (
    Cancel,
    DecodeTask,
    Heartbeat,
    KVEvents,
    MeshStatus,
    PrefillTask,
    Reservation,
    Reserve,
    StatusQuery,
    SubmitAck,
    SubmitRequest,
    TaskAck,
    WireError,
    WorkerLost,
)
from shared.subjects import SCHEDULER_QUEUE_GROUP, Subjects
from shared.telemetry.metrics import SchedulerMetrics
from shared.telemetry.tracing import extract, fail, inject, setup_tracing

log = logging.getLogger(__name__)
Reply = TypeVar("Reply", TaskAck, Reservation)


class WorkerGone(Exception):
    """The worker a placement was waiting on stopped beating (the sweeper expired it)."""


class InvalidRequest(Exception):
    """A worker's engine refused the request itself: no other worker would take it."""


_REQUEST_ERRORS = (TimeoutError, NatsError, WireError, WorkerGone)


CANCEL_MEMORY_S = 120.0  # how long a Cancel stops a placement still in progress


class SchedulerService:
    def __init__(
        self, config: SchedulerConfig, bus: Bus, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        self.bus = bus
        self.clock = clock
        self.subjects = Subjects(config.namespace)
        self.registry = Registry(config.heartbeat_timeout)
        self.placing = 0  # submits being placed right now (bounded by max_queue)
        self.admitted = 0
        self.rejected = 0
        self.tracing = setup_tracing("scheduler", config.otlp_endpoint)
        self.metrics = SchedulerMetrics()
        self._sweeper: asyncio.Task[None] | None = None
        # Request ids cancelled lately (id -> when): a placement still in progress for one
        # stops instead of starting work nobody will read (the gateway migrated it).
        self.cancelled: dict[str, float] = {}
        # Requests to workers in flight (worker id -> their tasks): cancelled when the worker
        # is lost, so a placement moves on without waiting out `reserve_timeout`.
        self.asking: dict[str, set[asyncio.Task[object]]] = {}

    async def start(self) -> None:
        s = self.subjects
        await self.bus.subscribe(s.heartbeat, Heartbeat, self._on_heartbeat)
        await self.bus.subscribe(s.kv_events, KVEvents, self._on_kv_events)
        await self.bus.subscribe(s.cancel, Cancel, self._on_cancel)
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
        await self.bus.nc.flush()
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        """Stop the sweeper; placements in progress finish while the bus drains."""
        if self._sweeper:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    def on_reconnect(self) -> None:
        self.registry.touch_all(self.clock())

    # -- subscriptions ------------------------------------------------------------------
    async def _on_heartbeat(self, heartbeat: Heartbeat, headers: Headers) -> None:
        if heartbeat.worker_id not in self.registry:
            log.info("worker %s joined (role %s)", heartbeat.worker_id, heartbeat.role)
        self.registry.on_heartbeat(heartbeat, self.clock())

    async def _on_kv_events(self, events: KVEvents, headers: Headers) -> None:
        self.registry.on_kv_events(events)

    async def _on_cancel(self, cancel: Cancel, headers: Headers) -> None:
        self.registry.forget(cancel.request_id)
        self.cancelled[cancel.request_id] = self.clock()

    async def on_status(self, query: StatusQuery, headers: Headers) -> MeshStatus:
        return MeshStatus(self.registry.status(), self.placing, self.admitted, self.rejected)

    async def sweep(self) -> None:
        now = self.clock()
        self._count_workers()
        for state in self.registry.expire(now):
            worker_id = state.heartbeat.worker_id
            lost = sorted(state.assigned)
            log.warning("worker %s lost (no heartbeat); %d requests on it", worker_id, len(lost))
            for call in self.asking.pop(worker_id, set()):
                call.cancel()
            await self.bus.publish(self.subjects.events, WorkerLost(worker_id, lost))
        self.registry.forget_past_deadline(now)
        horizon = now - CANCEL_MEMORY_S
        self.cancelled = {r: t for r, t in self.cancelled.items() if t > horizon}

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            try:
                await self.sweep()
            except Exception:
                log.exception("sweep failed")

    # -- placement ----------------------------------------------------------------------
    async def on_submit(self, request: SubmitRequest, headers: Headers) -> SubmitAck:
        with self.tracing.tracer.start_as_current_span(
            "scheduler.route", extract(headers), kind=SpanKind.SERVER
        ) as span:
            span.set_attribute("splitserve.request_id", request.request_id)
            ack = await self._admit(request, inject(span))
            span.set_attributes(
                {
                    "splitserve.accepted": ack.accepted,
                    "splitserve.prefill_worker": ack.prefill_worker,
                    "splitserve.decode_worker": ack.decode_worker,
                    "splitserve.disaggregated": bool(ack.prefill_worker),
                }
            )
            if not ack.accepted:
                fail(span, ack.error)
        path = "disaggregated" if ack.prefill_worker else "decode_only" if ack.accepted else ""
        self.metrics.placements.labels("accepted" if ack.accepted else "refused", path).inc()
        return ack

    async def _admit(self, request: SubmitRequest, headers: Headers) -> SubmitAck:
        if self.placing >= self.config.max_queue:
            self.rejected += 1
            return self._no_worker(request, "scheduler busy: too many requests being placed")
        self.placing += 1
        self.metrics.waiting.set(self.placing)
        try:
            ack = await self._place(request, headers)
        except InvalidRequest as exc:
            await self.bus.publish(  # frees a reservation already taken
                self.subjects.cancel, Cancel(request.request_id, "invalid"), headers=headers
            )
            ack = SubmitAck(request.request_id, False, str(exc), invalid=True)
        finally:
            self.placing -= 1
            self.metrics.waiting.set(self.placing)
        if ack.accepted:
            self.admitted += 1
        else:
            self.rejected += 1
        return ack

    def _count_workers(self) -> None:
        self.metrics.workers.clear()
        for view in self.registry.views():
            state = "draining" if view.draining else "ready"
            self.metrics.workers.labels(view.role, state).inc()

    async def _place(self, request: SubmitRequest, headers: Headers) -> SubmitAck:
        cfg = self.config
        if request.deadline <= self.clock():
            return SubmitAck(request.request_id, False, "deadline already passed")
        tokens = request.prompt_token_ids + request.delivered_token_ids
        hashes = hash_full_blocks(tokens, cfg.block_size, self.registry.model_id(cfg.model_id))
        views = self.registry.views()
        decodes = rank_decode(views, hashes, len(tokens), cfg.block_size, cfg.load_penalty)
        if not decodes:
            has_decode = any(v.role in ("decode", "both") and not v.draining for v in views)
            why = "no decode worker with enough free KV blocks" if has_decode else ""
            return self._no_worker(request, why or "no worker for role decode")
        prefills = rank_prefill(views, hashes, cfg.load_penalty)
        for decode in decodes:
            local = prefills_locally(
                len(tokens),
                decode.overlap,
                cfg.block_size,
                cfg.local_prefill_tokens,
                bool(prefills),
            )
            trace.get_current_span().set_attribute("splitserve.prefix_hit_blocks", decode.overlap)
            if local:
                if await self._decode_only(request, decode, headers):
                    self._assign(request, decode.worker_id, len(tokens))
                    self.registry.expect_cached(decode.worker_id, hashes)
                    return SubmitAck(request.request_id, True, decode_worker=decode.worker_id)
                continue
            reservation = await self._reserve(request, tokens, decode, headers)
            if reservation is None:
                continue
            for prefill in prefills:
                if request.request_id in self.cancelled:  # Cancel frees the reservation too
                    return SubmitAck(request.request_id, False, "cancelled while being placed")
                if await self._prefill(request, prefill, decode, reservation, headers):
                    self._assign(request, decode.worker_id, len(tokens))
                    self._assign(request, prefill.worker_id, 0)
                    # The decode worker holds the blocks only once the transfer is done.
                    self.registry.expect_cached(prefill.worker_id, hashes)
                    return SubmitAck(
                        request.request_id,
                        True,
                        prefill_worker=prefill.worker_id,
                        decode_worker=decode.worker_id,
                    )
            await self.bus.publish(
                self.subjects.cancel,
                Cancel(request.request_id, "no prefill worker took the request"),
                headers=headers,
            )
            return self._no_worker(request, "no worker for role prefill accepted the request")
        return self._no_worker(request, "no decode worker accepted the request")

    def _no_worker(self, request: SubmitRequest, error: str) -> SubmitAck:
        log.info("%s refused: %s", request.request_id, error)
        return SubmitAck(request.request_id, False, error, retry_after=self.config.retry_after)

    def _assign(self, request: SubmitRequest, worker_id: str, num_tokens: int) -> None:
        self.registry.assign(worker_id, request.request_id, request.deadline, num_tokens)

    def _timeout(self, request: SubmitRequest) -> float:
        return max(0.001, min(self.config.reserve_timeout, request.deadline - self.clock()))

    async def _decode_only(
        self, request: SubmitRequest, decode: Candidate, headers: Headers
    ) -> bool:
        subject = self.subjects.decode(decode.worker_id)
        return await self._task(decode.worker_id, subject, DecodeTask(request), request, headers)

    async def _prefill(
        self,
        request: SubmitRequest,
        prefill: Candidate,
        decode: Candidate,
        reservation: Reservation,
        headers: Headers,
    ) -> bool:
        task = PrefillTask(request, decode.worker_id, reservation.num_cached_blocks)
        subject = self.subjects.prefill(prefill.worker_id)
        return await self._task(prefill.worker_id, subject, task, request, headers)

    async def _ask(
        self,
        worker_id: str,
        subject: str,
        message: Reserve | DecodeTask | PrefillTask,
        reply_type: type[Reply],
        request: SubmitRequest,
        headers: Headers,
    ) -> Reply:
        """Request/reply with one worker, bounded by `_timeout`; WorkerGone as soon as the
        sweeper finds that worker lost (NATS may still hold the message for a dead one)."""
        call = asyncio.ensure_future(
            self.bus.request(subject, message, reply_type, self._timeout(request), headers=headers)
        )
        calls = self.asking.setdefault(worker_id, set())
        calls.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this placement itself is being cancelled
            raise WorkerGone(f"worker {worker_id} was lost") from None
        finally:
            calls.discard(call)
            if not calls and self.asking.get(worker_id) is calls:
                del self.asking[worker_id]

    async def _task(
        self,
        worker_id: str,
        subject: str,
        task: DecodeTask | PrefillTask,
        request: SubmitRequest,
        headers: Headers,
    ) -> bool:
        try:
            ack = await self._ask(worker_id, subject, task, TaskAck, request, headers)
        except _REQUEST_ERRORS as exc:
            log.warning("%s: %s failed: %r", request.request_id, subject, exc)
            return False
        if not ack.ok:
            log.info("%s: %s refused: %s", request.request_id, subject, ack.error)
            if ack.invalid:
                raise InvalidRequest(ack.error)
        return ack.ok

    async def _reserve(
        self, request: SubmitRequest, tokens: list[int], decode: Candidate, headers: Headers
    ) -> Reservation | None:
        subject = self.subjects.reserve(decode.worker_id)
        message = Reserve(request)
        try:
            reservation = await self._ask(
                decode.worker_id, subject, message, Reservation, request, headers
            )
        except _REQUEST_ERRORS as exc:
            log.warning("%s: reserve on %s failed: %r", request.request_id, decode.worker_id, exc)
            return None
        if not reservation.ok:
            log.info("%s: %s refused: %s", request.request_id, subject, reservation.error)
            if reservation.invalid:
                raise InvalidRequest(reservation.error)
            return None
        return reservation


def _bad_submit(reason: str) -> SubmitAck:
    return SubmitAck("", False, f"bad SubmitRequest: {reason}")


def _bad_status(reason: str) -> MeshStatus:
    return MeshStatus([], 0, 0, 0)
