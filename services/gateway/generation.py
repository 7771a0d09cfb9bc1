"""One request's life on the mesh: submit, then turn TokenChunks into text events.

`Mesh.submit` asks the scheduler (request/reply) and opens the request's token stream;
refusals become ApiErrors (INVALID: 400; BUSY, a full scheduler queue: 429 with Retry-After;
UNAVAILABLE or FAILED, no worker took it within the scheduler's queue timeout: 503 with
Retry-After), retried for `retry_for` seconds when the caller asks (a later choice of an
accepted request). A submit that no scheduler subscribes to (one restarting, or moving to
another NATS node after its own died) is asked again for `scheduler_grace` seconds, then
503. `Mesh.events` then yields Delta and Finish: it detokenizes, applies stop strings, and
enforces the stall timeout and the request deadline. Whenever it ends without the worker's
own finish (stop string, error, timeout, client gone), it publishes Cancel so every worker
frees the request's blocks.

Migration: when an attempt fails after acceptance (an error chunk, `WorkerLost`, an abort,
or no token for the stall timeout), the gateway cancels it and resubmits the prompt plus
the tokens delivered so far as attempt + 1 under the id `<id>~<attempt>`, at most
`migration_limit` times, retrying refusals until the stall timeout or the deadline. The
gateway fixes the seed before the first submit, so a migrated sampled request draws the
same tokens (the draw at each position depends only on seed and position).
Both run inside the `gateway.request` span (app.py): the submit carries its traceparent,
and the span gets the usage and finish reason. Latencies count from the submit (after
tokenization) to a chunk with tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from opentelemetry import trace

from services.gateway.config import GatewayConfig
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import ApiError
from services.gateway.prompting import ModelText
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.streams import RequestStream, TokenStreams
from shared.bus import Bus
from shared.engine.sampling_params import SamplingParams
from shared.protocol import (
    Cancel,
    Outcome,
    PromptTokenLogprob,
    SubmitAck,
    SubmitRequest,
    TokenChunk,
    TokenLogprob,
)
from shared.subjects import Subjects
from shared.telemetry.metrics import GatewayMetrics
from shared.telemetry.tracing import fail, inject

log = logging.getLogger(__name__)
T = TypeVar("T")
NO_SCHEDULER_POLL_S = 0.1  # a submit nobody subscribes to is asked again this often


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
        }


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt_logprobs: on the first delta, prompt tokens 1.. scored
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class Finish:
    reason: str  # "stop" | "length"
    usage: Usage


class GenerationFailed(Exception):
    """The request failed after it was accepted; `status` is for a non-streamed reply."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class OutputText:
    skip_special_tokens: bool = True
    include_stop_str: bool = False  # a matched stop string stays in the text
    keep_tokens: frozenset[int] = frozenset()  # special tokens shown all the same


@dataclass(slots=True)
class Submitted:
    request_id: str
    stream: RequestStream
    num_prompt_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    deadline: float  # loop time
    submitted: float  # perf_counter() when the submit began
    message: SubmitRequest  # the current attempt, as submitted
    output: OutputText  # how its tokens become text
    delivered: list[int] = field(default_factory=list)  # tokens streamed to the client
    # Set when the first token arrives (or a finish without any); never on a failure.
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_scored: bool = False  # its prompt logprobs have gone to the client


class Mesh:
    def __init__(
        self,
        config: GatewayConfig,
        bus: Bus,
        streams: TokenStreams,
        text: ModelText,
        metrics: GatewayMetrics,
        model: str = "",
        has_fallback: bool = False,
    ) -> None:
        """`model`: the served model whose workers take the requests ("": any worker, the
        one-model mesh); `has_fallback`: the router has another model to try after it."""
        self.config = config
        self.model = model
        self.has_fallback = has_fallback
        self.metrics = metrics
        self.bus = bus
        self.subjects = Subjects(config.common.namespace)
        self.streams = streams
        self.text = text

    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stop: tuple[str, ...],
        retry_for: float = 0.0,
        output: OutputText = OutputText(),
    ) -> Submitted:
        """Submit one request; a refusal is an ApiError, after `retry_for` seconds of retries."""
        submitted = time.perf_counter()
        span = trace.get_current_span()
        span.set_attributes(
            {"splitserve.request_id": request_id, "gen_ai.usage.input_tokens": len(prompt_ids)}
        )
        loop = asyncio.get_running_loop()
        loop_deadline = loop.time() + self.config.request_timeout
        if sampling.seed is None:  # fixed here, so that a migrated request draws the same
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        message = SubmitRequest(
            request_id=request_id,
            gateway_id=self.config.gateway_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            deadline=time.time() + self.config.request_timeout,
            model=self.model,
            has_fallback=self.has_fallback,
        )
        stream = await self._retrying(lambda: self._open(message), loop.time() + retry_for)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return Submitted(
            request_id,
            stream,
            len(prompt_ids),
            sampling,
            stop,
            loop_deadline,
            submitted,
            message,
            output,
        )

    async def _open(self, message: SubmitRequest) -> RequestStream:
        """A new request, if this gateway has room for one more in flight."""
        if len(self.streams.open) >= self.config.max_pending:
            raise ApiError(429, "too many requests in flight on this gateway", retry_after=1)
        return await self._send(message)

    async def _send(self, message: SubmitRequest) -> RequestStream:
        """Open the attempt's token stream, then submit it; a refusal is an ApiError."""
        request_id = message.request_id
        # Opened before submitting, so no token is missed.
        stream = self.streams.open_stream(request_id, len(message.delivered_token_ids))
        try:
            ack = await self._ask_scheduler(message)
        except (NoRespondersError, TimeoutError, NatsError) as exc:
            self.streams.close_stream(request_id)
            why = "no scheduler answered" if isinstance(exc, NoRespondersError) else "timed out"
            why = why if isinstance(exc, (NoRespondersError, TimeoutError)) else repr(exc)
            raise ApiError(503, f"the scheduler is unavailable ({why})", retry_after=1) from None
        except BaseException:  # cancelled: the scheduler may place it all the same
            self.streams.close_stream(request_id)
            await self._cancel(request_id)
            raise
        if not ack.accepted:
            self.streams.close_stream(request_id)
            if ack.outcome == Outcome.INVALID:
                raise ApiError(400, f"invalid request: {ack.error}")
            # BUSY: the scheduler's queue is full; UNAVAILABLE / FAILED: no worker took it.
            status = 429 if ack.outcome == Outcome.BUSY else 503
            raise ApiError(
                status, f"request refused: {ack.error or 'overloaded'}", retry_after=ack.retry_after
            )
        stream.prefill_worker = ack.prefill_worker
        return stream

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

    async def events(self, job: Submitted) -> AsyncIterator[Delta | Finish]:
        output = job.output
        detokenizer = IncrementalDetokenizer(
            self.text.tokenizer, output.skip_special_tokens, output.keep_tokens
        )
        stops = StopStringMatcher(job.stop)
        completion_tokens = 0
        finished = False
        outcome = "cancelled"  # the client went away, unless set below
        last_chunk: float | None = None
        self.metrics.running.inc()
        try:
            while True:
                chunk = await self._next_chunk(job)
                if chunk.error or chunk.finish_reason == "abort":
                    await self._migrate(job, chunk.error or "the request was aborted by the mesh")
                    continue
                if chunk.token_ids:
                    last_chunk = self._observe_chunk(job, last_chunk)
                job.delivered += chunk.token_ids
                if chunk.token_ids or chunk.finish_reason:
                    job.first_token.set()
                completion_tokens += len(chunk.token_ids)
                scored = [] if job.prompt_scored else chunk.prompt_logprobs
                job.prompt_scored = job.prompt_scored or bool(scored)  # a migration scores again
                text, stopped = stops.feed(detokenizer.add(chunk.token_ids))
                if chunk.finish_reason and not stopped:
                    text += stops.feed(detokenizer.flush())[0] + stops.flush()
                if stopped and job.output.include_stop_str:
                    text += stops.matched
                if text or chunk.logprobs or scored:
                    yield Delta(text, chunk.token_ids, chunk.logprobs, scored)
                if stopped or chunk.finish_reason:
                    finished = not stopped  # a stop string still needs the Cancel below
                    reason = outcome = "stop" if stopped else chunk.finish_reason or "stop"
                    self.metrics.e2e.observe(time.perf_counter() - job.submitted)
                    yield Finish(reason, Usage(job.num_prompt_tokens, completion_tokens))
                    return
        except GenerationFailed as exc:
            outcome = "error"
            fail(trace.get_current_span(), exc)
            raise
        finally:
            self._account(outcome, completion_tokens)
            self.streams.close_stream(job.message.request_id)
            if not finished:
                await self._cancel(job.message.request_id)

    def _observe_chunk(self, job: Submitted, last_chunk: float | None) -> float:
        """TTFT for the first chunk with tokens, else the gap since the last one."""
        now = time.perf_counter()
        if last_chunk is None:
            self.metrics.ttft.observe(now - job.submitted)
        else:
            self.metrics.itl.observe(now - last_chunk)
        return now

    def _account(self, outcome: str, completion_tokens: int) -> None:
        self.metrics.running.dec()
        self.metrics.requests.labels(outcome).inc()
        self.metrics.generation_tokens.inc(completion_tokens)
        trace.get_current_span().set_attributes(
            {
                "gen_ai.usage.output_tokens": completion_tokens,
                "gen_ai.response.finish_reasons": [outcome],
            }
        )

    async def _next_chunk(self, job: Submitted) -> TokenChunk:
        """The next chunk of the current attempt; a stall migrates, the deadline fails."""
        while True:
            left = job.deadline - asyncio.get_running_loop().time()
            try:
                return await asyncio.wait_for(
                    job.stream.queue.get(), min(left, self.config.stall_timeout)
                )
            except TimeoutError:
                if left <= self.config.stall_timeout:
                    raise GenerationFailed(
                        f"request timed out after {self.config.request_timeout:g}s", 504
                    ) from None
                stalled = f"no token for {self.config.stall_timeout:g}s: the mesh stalled"
                await self._migrate(job, stalled, 504)

    async def _migrate(self, job: Submitted, why: str, status: int = 502) -> None:
        """Cancel the failed attempt and resubmit prompt + delivered tokens as attempt + 1;
        GenerationFailed when the migration limit is reached or no worker takes it in time."""
        old = job.message
        self.streams.close_stream(old.request_id)
        await self._cancel(old.request_id)  # frees whatever the failed attempt still holds
        if old.attempt >= self.config.migration_limit:
            tries = f" (after {old.attempt} migrations)" if old.attempt else ""
            raise GenerationFailed(why + tries, status)
        attempt = old.attempt + 1
        job.message = dataclasses.replace(
            old,
            request_id=f"{job.request_id}~{attempt}",
            attempt=attempt,
            delivered_token_ids=list(job.delivered),
        )
        log.warning(
            "%s: %s; migrating with %d delivered tokens (attempt %d)",
            job.request_id,
            why,
            len(job.delivered),
            attempt,
        )
        self.metrics.migrations.inc()
        job.stream = await self._resubmit(job, why)

    async def _resubmit(self, job: Submitted, why: str) -> RequestStream:
        """Submit the migrated attempt, retrying refusals until the stall timeout passes."""
        loop = asyncio.get_running_loop()
        give_up = min(job.deadline, loop.time() + self.config.stall_timeout)
        try:
            return await self._retrying(lambda: self._send(job.message), give_up)
        except ApiError as exc:
            raise GenerationFailed(f"{why}; migration refused: {exc}", 503) from None

    @staticmethod
    async def _retrying(send: Callable[[], Awaitable[T]], give_up: float) -> T:
        """`send()`, again after a refusal (429/503) while `give_up` (loop time) allows,
        waiting its retry_after (0.2 to 1 s); the last refusal is re-raised."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return await send()
            except ApiError as exc:
                wait = min(max(exc.retry_after or 0.0, 0.2), 1.0)
                if loop.time() + wait > give_up or exc.status not in (429, 503):
                    raise
                await asyncio.sleep(wait)

    async def abandon(self, job: Submitted) -> None:
        """Close and cancel a submitted request whose events did not run to their end (never
        started, or cut off before their cleanup); a no-op once they have."""
        request_id = job.message.request_id
        if self.streams.open.get(request_id) is job.stream:
            self.streams.close_stream(request_id)
            await self._cancel(request_id)

    async def _cancel(self, request_id: str) -> None:
        try:
            await self.bus.publish(self.subjects.cancel, Cancel(request_id, "gateway"))
        except Exception:
            log.exception("%s: could not publish Cancel", request_id)
