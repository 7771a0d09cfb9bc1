"""A submitted request's token stream as text events: `token_events(client, job)`.

It yields Delta and Finish: it detokenizes, applies stop strings, migrates a failed or
stalled attempt (migration.py) and enforces the request deadline. It runs inside the
`gateway.request` span (app.py), which gets the usage and finish reason. Latencies count
from the submit (after tokenization) to a chunk with tokens.
Subtle rule: whenever it ends without the worker's own finish (stop string, error,
timeout, client gone), it publishes Cancel so every worker frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.gateway_request import GatewayRequest
from services.gateway.migration import migrate
from services.gateway.model_client import ModelClient
from services.gateway.refusals import Failure, GenerationFailed
from services.gateway.stop_strings import StopStringMatcher
from shared.protocol import FinishReason, PromptTokenLogprob, TokenChunk, TokenLogprob
from shared.telemetry.tracing import fail


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


async def token_events(client: ModelClient, job: GatewayRequest) -> AsyncIterator[Delta | Finish]:
    output = job.spec.output
    detokenizer = IncrementalDetokenizer(
        client.text.tokenizer, output.skip_special_tokens, output.keep_tokens
    )
    stops = StopStringMatcher(job.spec.stop)
    metrics = client.metrics
    completion_tokens = 0
    finished = False
    outcome = "cancelled"  # the client went away, unless set below
    last_chunk: float | None = None
    metrics.running.inc()
    try:
        while True:
            chunk = await _next_chunk(client, job)
            if chunk.error or chunk.finish_reason == FinishReason.ABORT:
                await migrate(client, job, chunk.error or "the request was aborted by the mesh")
                continue
            if chunk.token_ids:
                last_chunk = _observe_chunk(client, job, last_chunk)
            job.delivered += chunk.token_ids
            if chunk.token_ids or chunk.finish_reason is not None:
                job.first_token.set()
            completion_tokens += len(chunk.token_ids)
            scored = [] if job.prompt_scored else chunk.prompt_logprobs
            job.prompt_scored = job.prompt_scored or bool(scored)  # a migration scores again
            text, stopped = stops.feed(detokenizer.add(chunk.token_ids))
            if chunk.finish_reason is not None and not stopped:
                text += stops.feed(detokenizer.flush())[0] + stops.flush()
            if stopped and output.include_stop_str:
                text += stops.matched
            if text or chunk.logprobs or scored:
                yield Delta(text, chunk.token_ids, chunk.logprobs, scored)
            if stopped or chunk.finish_reason is not None:
                finished = not stopped  # a stop string still needs the Cancel below
                reason = outcome = "stop" if stopped else chunk.finish_reason.name.lower()
                metrics.e2e.observe(time.perf_counter() - job.submitted)
                yield Finish(reason, Usage(len(job.spec.prompt_ids), completion_tokens))
                return
    except GenerationFailed as exc:
        outcome = "error"
        fail(trace.get_current_span(), exc)
        raise
    finally:
        _account(client, outcome, completion_tokens)
        client.streams.close_stream(job.wire_id)
        if not finished:
            await client.cancel(job.wire_id)


def _observe_chunk(client: ModelClient, job: GatewayRequest, last_chunk: float | None) -> float:
    """TTFT for the first chunk with tokens, else the gap since the last one."""
    now = time.perf_counter()
    if last_chunk is None:
        client.metrics.ttft.observe(now - job.submitted)
    else:
        client.metrics.itl.observe(now - last_chunk)
    return now


def _account(client: ModelClient, outcome: str, completion_tokens: int) -> None:
    metrics = client.metrics
    metrics.running.dec()
    metrics.requests.labels(outcome).inc()
    metrics.generation_tokens.inc(completion_tokens)
    if client.adapter:
        metrics.lora_tokens.labels(client.adapter, "generation").inc(completion_tokens)
    trace.get_current_span().set_attributes(
        {
            "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.response.finish_reasons": [outcome],
        }
    )


async def _next_chunk(client: ModelClient, job: GatewayRequest) -> TokenChunk:
    """The next chunk of the current attempt; a stall migrates, the deadline fails."""
    stall_timeout = client.config.stall_timeout
    while True:
        left = job.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(job.stream.queue.get(), min(left, stall_timeout))
        except TimeoutError:
            if left <= stall_timeout:
                timeout = client.config.request_timeout
                message = f"request timed out after {timeout:g}s"
                raise GenerationFailed(message, Failure.TIMED_OUT) from None
            stalled = f"no token for {stall_timeout:g}s: the mesh stalled"
            await migrate(client, job, stalled, Failure.TIMED_OUT)
