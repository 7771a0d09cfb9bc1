"""`ModelClient`: the gateway's client of one served model's workers, made once per model.

It holds the model's config, text (tokenizer, chat template) and the shared bus, token
streams and metrics. `submit` asks the scheduler (request/reply) for a `GatewayRequest`'s
first attempt and opens its token stream; `send` does it for any attempt (migration.py).
Refusals are `Refused` values (refusals.py): the scheduler's own outcome (INVALID, BUSY: a
full queue, UNAVAILABLE or FAILED: no worker took it within its queue timeout), BUSY when
this gateway has `max_pending` requests in flight, UNAVAILABLE when no scheduler answers.
`retrying` asks again after a refusal that allows it, for as long as its caller says. A
submit that no scheduler subscribes to (one restarting, or moving to another NATS node
after its own died) is asked again for `scheduler_grace` seconds first.
Subtle rule: a token stream is opened before its submit, so no token is missed, and every
way out of a send that was not accepted closes it again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from opentelemetry import trace

from services.gateway.config import GatewayConfig
from services.gateway.gateway_request import GatewayRequest, RequestSpec
from services.gateway.prompting import ModelText
from services.gateway.refusals import Refused
from services.gateway.streams import RequestStream, TokenStreams
from shared.bus import Bus
from shared.protocol import Cancel, Outcome, SubmitAck, SubmitRequest
from shared.subjects import Subjects
from shared.telemetry.metrics import GatewayMetrics
from shared.telemetry.tracing import inject

log = logging.getLogger(__name__)
T = TypeVar("T")
NO_SCHEDULER_POLL_S = 0.1  # a submit nobody subscribes to is asked again this often


class ModelClient:
    def __init__(
        self,
        config: GatewayConfig,
        bus: Bus,
        streams: TokenStreams,
        text: ModelText,
        metrics: GatewayMetrics,
        model: str = "",
    ) -> None:
        """`model`: the served model whose workers take the requests ("": any worker, the
        one-model mesh)."""
        self.config = config
        self.model = model
        self.metrics = metrics
        self.bus = bus
        self.subjects = Subjects(config.common.namespace)
        self.streams = streams
        self.text = text
        self.adapter = ""  # a LoRA adapter's client (for_adapter): every request uses it

    def for_adapter(self, adapter: str) -> ModelClient:
        """The same model's client for requests of LoRA `adapter`; its answers name it."""
        config = dataclasses.replace(self.config, served_model_name=adapter)
        client = ModelClient(config, self.bus, self.streams, self.text, self.metrics, self.model)
        client.adapter = adapter
        return client

    @property
    def name(self) -> str:
        """The model's name, as clients call it."""
        return self.config.served_model_name

    async def submit(self, spec: RequestSpec, retry_for: float = 0.0) -> GatewayRequest:
        """Submit a request's first attempt; Refused after `retry_for` seconds of retries."""
        submitted = time.perf_counter()
        span = trace.get_current_span()
        span.set_attributes(
            {
                "splitserve.request_id": spec.request_id,
                "gen_ai.usage.input_tokens": len(spec.prompt_ids),
            }
        )
        loop = asyncio.get_running_loop()
        if spec.sampling.seed is None:  # fixed here, so that a migrated request draws the same
            seeded = dataclasses.replace(spec.sampling, seed=secrets.randbits(63))
            spec = dataclasses.replace(spec, sampling=seeded)
        if self.adapter:  # every attempt (migration too) carries it
            adapted = dataclasses.replace(spec.sampling, adapter=self.adapter)
            spec = dataclasses.replace(spec, sampling=adapted)
            self.metrics.lora_requests.labels(self.adapter).inc()
            self.metrics.lora_tokens.labels(self.adapter, "prompt").inc(len(spec.prompt_ids))
        timeout = self.config.request_timeout
        job = GatewayRequest(spec, loop.time() + timeout, time.time() + timeout, submitted)
        job.stream = await retrying(lambda: self._open(job), loop.time() + retry_for)
        self.metrics.prompt_tokens.inc(len(spec.prompt_ids))
        return job

    async def _open(self, job: GatewayRequest) -> RequestStream:
        """A new request, if this gateway has room for one more in flight."""
        if len(self.streams.open) >= self.config.max_pending:
            raise Refused(Outcome.BUSY, "too many requests in flight on this gateway", 1)
        return await self.send(job)

    async def send(self, job: GatewayRequest) -> RequestStream:
        """Open the current attempt's token stream, then submit the attempt."""
        wire_id = job.wire_id
        stream = self.streams.open_stream(wire_id, len(job.delivered))
        try:
            ack = await self._ask_scheduler(self._message(job))
        except (NoRespondersError, TimeoutError, NatsError) as exc:
            self.streams.close_stream(wire_id)
            why = "no scheduler answered" if isinstance(exc, NoRespondersError) else "timed out"
            why = why if isinstance(exc, (NoRespondersError, TimeoutError)) else repr(exc)
            message = f"the scheduler is unavailable ({why})"
            raise Refused(Outcome.UNAVAILABLE, message, 1) from None
        except BaseException:  # cancelled: the scheduler may place it all the same
            self.streams.close_stream(wire_id)
            await self.cancel(wire_id)
            raise
        if not ack.accepted:
            self.streams.close_stream(wire_id)
            if ack.outcome == Outcome.INVALID:
                raise Refused(ack.outcome, f"invalid request: {ack.error}")
            message = f"request refused: {ack.error or 'overloaded'}"
            raise Refused(ack.outcome, message, ack.retry_after)
        stream.prefill_worker, stream.decode_worker = ack.prefill_worker, ack.decode_worker
        return stream

    def _message(self, job: GatewayRequest) -> SubmitRequest:
        """The current attempt, as submitted; a migrated one names the previous attempt's
        split (its stream is still `job.stream` while the next is being sent)."""
        split = job.stream if job.attempt and job.stream.prefill_worker else None
        return SubmitRequest(
            request_id=job.wire_id,
            gateway_id=self.config.gateway_id,
            prompt_token_ids=job.spec.prompt_ids,
            sampling=job.spec.sampling,
            deadline=job.wall_deadline,
            attempt=job.attempt,
            delivered_token_ids=list(job.delivered),
            model=self.model,
            has_fallback=job.spec.has_fallback,
            submitted_at=time.time(),
            tenant=job.spec.tenant,
            priority=job.spec.priority,
            last_prefill=split.prefill_worker if split else "",
            last_decode=split.decode_worker if split else "",
            last_delivered=split.first_index if split else 0,
        )

    async def _ask_scheduler(self, message: SubmitRequest) -> SubmitAck:
        """The scheduler's answer to `message`; asked again while none subscribes (nothing
        was placed then), `scheduler_grace` seconds at most. A submit that had to ask again
        is timed in `gateway_scheduler_wait_seconds`, until the try that found a scheduler
        (not its answer, which may wait in the scheduler's queue)."""
        loop = asyncio.get_running_loop()
        asked = tried = loop.time()
        waits = self.metrics.scheduler_waits
        while True:
            try:
                ack = await self.bus.request(
                    self.subjects.submit,
                    message,
                    SubmitAck,
                    timeout=self.config.submit_timeout,
                    headers=inject(trace.get_current_span()),
                )
            except NoRespondersError:
                if loop.time() + NO_SCHEDULER_POLL_S > asked + self.config.scheduler_grace:
                    if tried > asked:
                        waits.labels("unanswered").observe(loop.time() - asked)
                    raise
            else:
                if tried > asked:
                    waits.labels("answered").observe(tried - asked)
                return ack
            if tried == asked:
                log.warning(
                    "%s: no scheduler subscribed; asking again for up to %.1f s",
                    message.request_id,
                    self.config.scheduler_grace,
                )
            await asyncio.sleep(NO_SCHEDULER_POLL_S)
            tried = loop.time()

    async def abandon(self, job: GatewayRequest) -> None:
        """Close and cancel a submitted request whose events did not run to their end (never
        started, or cut off before their cleanup); a no-op once they have."""
        wire_id = job.wire_id
        if self.streams.open.get(wire_id) is job.stream:
            self.streams.close_stream(wire_id)
            await self.cancel(wire_id)

    async def cancel(self, wire_id: str) -> None:
        """Tell every worker to drop the attempt `wire_id` (and free its blocks)."""
        try:
            await self.bus.publish(self.subjects.cancel, Cancel(wire_id, "gateway"))
        except Exception:
            log.exception("%s: could not publish Cancel", wire_id)


async def retrying(send: Callable[[], Awaitable[T]], give_up: float) -> T:
    """`send()`, again after a refusal that allows it while `give_up` (loop time) allows,
    waiting its retry_after (0.2 to 1 s); the last refusal is raised."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await send()
        except Refused as exc:
            wait = min(max(exc.retry_after or 0.0, 0.2), 1.0)
            if loop.time() + wait > give_up or not exc.may_try_again:
                raise
            await asyncio.sleep(wait)
