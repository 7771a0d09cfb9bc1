"""What the prefill and decode sides of a worker share: connection, engine client, request
table, admission (`admit`, the same for every kind of work), and the one way tokens leave
the worker: `stream`/`fail` queue `TokenChunk`s on the outbox, which the runtime publishes in
order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from opentelemetry.context import Context

from services.worker.config import WorkerConfig, role_takes
from services.worker.engine_client import EngineClient
from services.worker.peer_reads import PeerReads
from services.worker.refusals import refusal
from services.worker.requests import RequestState, RequestTable, Trace, WorkerRequest
from services.worker.telemetry import WorkerTelemetry
from shared.bus import Bus
from shared.engine.outputs import RequestOutput
from shared.engine.sequence import FinishReason
from shared.kvtransfer import KVLayout
from shared.kvtransfer.link import KVLink
from shared.prefix_messages import PeerPrefix
from shared.protocol import Outcome, PromptTokenLogprob, SubmitRequest, TokenChunk, TokenLogprob
from shared.sleep_level import SleepLevel
from shared.subjects import Subjects

CHANGING = "changing role"  # the refusal of a side that a role change drops


@dataclass(slots=True)
class WorkerContext:
    config: WorkerConfig  # its `role` the current one: a role change replaces it
    bus: Bus
    subjects: Subjects
    engine: EngineClient
    layout: KVLayout
    table: RequestTable
    telemetry: WorkerTelemetry
    outbox: asyncio.Queue[tuple[str, TokenChunk]]  # to gateways, published in order
    link: KVLink  # the KV transports: each transfer's sender and receiver
    draining: bool = False  # set on SIGTERM: new tasks are refused
    next_role: str = ""  # mid-change (role_change.py): the role it changes to; "": none
    sleep_level: SleepLevel = SleepLevel.AWAKE  # asleep or falling asleep (sleep.py): no intake
    kv_blocks_sent: int = 0  # blocks shipped, each counted once however many layer groups
    kv_blocks_received: int = 0
    peer_reads: PeerReads | None = None  # prefix blocks read from other workers (set at start)

    async def admit(
        self,
        request: SubmitRequest,
        state: RequestState,
        parent: Context,
        take: Callable[[WorkerRequest], Awaitable[object]],
        *,
        decodes: bool,
        deadline_limit: float | None = None,
    ) -> tuple[WorkerRequest | None, Outcome, str]:
        """Take `request` in `state` unless draining, changing to a role without this side, or
        its id is held here; `take(entry)` (the engine's check and queueing, or a reservation)
        runs with it in the table already, so neither a Cancel nor the same id again is lost
        meanwhile. (entry, OK, "") or (None, the refusal)."""
        request_id = request.request_id
        if self.draining:
            return None, Outcome.UNAVAILABLE, "draining"
        if self.sleep_level:
            return None, Outcome.UNAVAILABLE, "asleep"
        if self.next_role and not role_takes(self.next_role, decodes):
            return None, Outcome.UNAVAILABLE, CHANGING
        if request_id in self.table:
            return None, Outcome.UNAVAILABLE, "duplicate request id"
        entry = self.new_request(
            request, state, parent, decodes=decodes, deadline_limit=deadline_limit
        )
        try:
            await take(entry)
        except Exception as exc:
            self.table.end(entry, "refused", time.time())
            return None, *refusal(request_id, exc)
        if self.table.get(request_id) is not entry:  # cancelled meanwhile
            self.engine.abort(request_id)
            return None, Outcome.UNAVAILABLE, "cancelled"
        return entry, Outcome.OK, ""

    async def read_prefix(self, request: SubmitRequest, hint: PeerPrefix | None) -> None:
        """Before `request` is queued: read the prefix blocks `hint` says another worker
        holds (never raises: a read not made or lost means they are computed)."""
        if self.peer_reads is not None:
            await self.peer_reads.read(request, hint)

    def new_request(
        self,
        request: SubmitRequest,
        state: RequestState,
        parent: Context,
        *,
        decodes: bool,
        deadline_limit: float | None = None,
    ) -> WorkerRequest:
        """Add `request` to the table in `state`; its stream resumes after what was delivered."""
        entry = WorkerRequest(
            request=request,
            state=state,
            deadline=loop_deadline(request.deadline, deadline_limit),
            subject=self.subjects.tokens(request.gateway_id),
            next_index=len(request.delivered_token_ids),
            trace=Trace(parent, time.time()),
            decodes=decodes,
        )
        self.table.add(entry)
        return entry

    def stream(self, entry: WorkerRequest, output: RequestOutput) -> None:
        """Queue the output's tokens (and finish) for the request's gateway."""
        self.outbox.put_nowait((entry.subject, token_chunk(output, entry.next_index)))
        entry.next_index += len(output.new_token_ids)

    def fail(self, entry: WorkerRequest, reason: str) -> None:
        """Tell the gateway the request failed here (it migrates it), and forget it."""
        error = TokenChunk(
            entry.request_id, entry.next_index, [], finish_reason=FinishReason.ABORT, error=reason
        )
        self.outbox.put_nowait((entry.subject, error))
        self.table.end(entry, reason, time.time())


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
        finish_reason=output.finish_reason,
        num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
        prompt_logprobs=[
            PromptTokenLogprob(lp.token_id, lp.logprob, lp.rank, [tuple(t) for t in lp.top])
            for lp in output.prompt_logprobs or []
        ],
    )
