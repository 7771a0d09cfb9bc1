"""One request's life on the mesh: submit, then turn TokenChunks into text events.

`Mesh.submit` asks the scheduler (request/reply) and opens the request's token stream;
refusals become ApiErrors (429/503 with Retry-After). `Mesh.events` then yields Delta and
Finish: it detokenizes, applies stop strings, and enforces the stall timeout and the
request deadline. Whenever it ends without the worker's own finish (stop string, error,
timeout, client gone), it publishes Cancel so every worker frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.errors import NoRespondersError

from services.gateway.config import GatewayConfig
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import ApiError
from services.gateway.prompting import ModelText
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.streams import RequestStream, TokenStreams
from shared.bus import Bus
from shared.engine.sampling_params import SamplingParams
from shared.protocol import Cancel, SubmitAck, SubmitRequest, TokenChunk, TokenLogprob
from shared.subjects import Subjects

log = logging.getLogger(__name__)


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


@dataclass(slots=True)
class Finish:
    reason: str  # "stop" | "length"
    usage: Usage


class GenerationFailed(Exception):
    """The request failed after it was accepted; `status` is for a non-streamed reply."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Submitted:
    request_id: str
    stream: RequestStream
    num_prompt_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    deadline: float  # loop time


class Mesh:
    def __init__(
        self, config: GatewayConfig, bus: Bus, streams: TokenStreams, text: ModelText
    ) -> None:
        self.config = config
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
    ) -> Submitted:
        if len(self.streams.open) >= self.config.max_pending:
            raise ApiError(429, "too many requests in flight on this gateway", retry_after=1)
        loop_deadline = asyncio.get_running_loop().time() + self.config.request_timeout
        message = SubmitRequest(
            request_id=request_id,
            gateway_id=self.config.gateway_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            deadline=time.time() + self.config.request_timeout,
        )
        stream = self.streams.open_stream(request_id)  # before submitting: no token is missed
        try:
            ack = await self.bus.request(
                self.subjects.submit, message, SubmitAck, timeout=self.config.submit_timeout
            )
        except (NoRespondersError, TimeoutError) as exc:
            self.streams.close_stream(request_id)
            why = "no scheduler answered" if isinstance(exc, NoRespondersError) else "timed out"
            raise ApiError(503, f"the scheduler is unavailable ({why})", retry_after=1) from None
        except BaseException:
            self.streams.close_stream(request_id)
            raise
        if not ack.accepted:
            self.streams.close_stream(request_id)
            status = 429 if ack.retry_after > 0 else 503
            raise ApiError(
                status, f"request refused: {ack.error or 'overloaded'}", retry_after=ack.retry_after
            )
        return Submitted(request_id, stream, len(prompt_ids), sampling, stop, loop_deadline)

    async def events(self, job: Submitted) -> AsyncIterator[Delta | Finish]:
        detokenizer = IncrementalDetokenizer(self.text.tokenizer)
        stops = StopStringMatcher(job.stop)
        completion_tokens = 0
        finished = False
        try:
            while True:
                chunk = await self._next_chunk(job)
                if chunk.error:
                    raise GenerationFailed(chunk.error)
                completion_tokens += len(chunk.token_ids)
                text, stopped = stops.feed(detokenizer.add(chunk.token_ids))
                if chunk.finish_reason and not stopped:
                    text += stops.feed(detokenizer.flush())[0] + stops.flush()
                if text or chunk.logprobs:
                    yield Delta(text, chunk.token_ids, chunk.logprobs)
                if stopped or chunk.finish_reason:
                    if chunk.finish_reason == "abort":
                        raise GenerationFailed("the request was aborted by the mesh")
                    finished = not stopped  # a stop string still needs the Cancel below
                    reason = "stop" if stopped else chunk.finish_reason or "stop"
                    yield Finish(reason, Usage(job.num_prompt_tokens, completion_tokens))
                    return
        finally:
            self.streams.close_stream(job.request_id)
            if not finished:
                await self._cancel(job.request_id)

    async def _next_chunk(self, job: Submitted) -> TokenChunk:
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
            raise GenerationFailed(
                f"no token for {self.config.stall_timeout:g}s: the mesh stalled", 504
            ) from None

    async def _cancel(self, request_id: str) -> None:
        try:
            await self.bus.publish(self.subjects.cancel, Cancel(request_id, "gateway"))
        except Exception:
            log.exception("%s: could not publish Cancel", request_id)
