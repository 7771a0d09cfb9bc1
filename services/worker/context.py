"""What the prefill and decode sides of a worker share: connection, engine, layout, and
the conversion of engine outputs to `TokenChunk`s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.worker.config import WorkerConfig
from services.worker.engine_thread import EngineThread
from shared.bus import Bus
from shared.engine.engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sequence import FinishReason
from shared.kvtransfer import KVLayout
from shared.protocol import SubmitRequest, TokenChunk, TokenLogprob
from shared.subjects import Subjects

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


@dataclass(slots=True)
class WorkerContext:
    config: WorkerConfig
    bus: Bus
    subjects: Subjects
    engine: EngineThread
    layout: KVLayout
    draining: bool = False  # set on SIGTERM: new tasks are refused
    kv_blocks_sent: int = 0  # blocks shipped, each counted once however many layer groups
    kv_blocks_received: int = 0


def admit(request: SubmitRequest, hold_kv: bool = False) -> Callable[[LLMEngine], None]:
    """The engine command that queues `request` (resumed after its delivered tokens)."""
    return lambda engine: engine.add_request(
        request.request_id,
        request.prompt_token_ids,
        request.sampling,
        output_token_ids=request.delivered_token_ids,
        hold_kv=hold_kv,
    )


def loop_deadline(unix_deadline: float, limit: float | None = None) -> float:
    """A wire deadline (Unix seconds) on the event loop's clock, at most `limit` from now."""
    remaining = unix_deadline - time.time()
    if limit is not None:
        remaining = min(remaining, limit)
    return asyncio.get_running_loop().time() + remaining


def token_chunk(output: RequestOutput, index: int) -> TokenChunk:
    return TokenChunk(
        request_id=output.request_id,
        index=index,
        token_ids=list(output.new_token_ids),
        logprobs=[
            TokenLogprob(lp.token_id, lp.logprob, [tuple(t) for t in lp.top])
            for lp in output.new_logprobs
        ],
        finish_reason=None
        if output.finish_reason is None
        else FINISH_REASONS[output.finish_reason],
        num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
    )


def error_chunk(request_id: str, index: int, error: str) -> TokenChunk:
    return TokenChunk(request_id, index, [], finish_reason="abort", error=error)
