"""One subscription on the gateway's token subject, demultiplexed into per-request queues.

Workers publish TokenChunks to <ns>.gateway.<id>.tokens; each open request has a queue
that its HTTP handler drains. A chunk whose tokens were all delivered already (same
`index`) is dropped, a partly repeated one is trimmed. A chunk that skips tokens (NATS is
at-most-once: a node that died with a chunk on its way) ends the attempt with an `error`
chunk, so the request migrates from the last token delivered instead of streaming a text
with a hole; the attempt's later chunks are dropped. Scheduler events (RequestFailed,
WorkerLost) for an open request arrive in its queue as a chunk carrying `error`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field

from nats.aio.subscription import Subscription

from shared.bus import Bus, Headers
from shared.protocol import RequestFailed, TokenChunk, WorkerLost
from shared.subjects import Subjects

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestStream:
    request_id: str
    queue: asyncio.Queue[TokenChunk] = field(default_factory=asyncio.Queue)
    next_index: int = 0  # output position of the next token not yet delivered
    prefill_worker: str = ""  # the attempt's prefill worker ("" on the decode-only path)
    decode_worker: str = ""  # the attempt's decode worker
    first_index: int = 0  # the output position it started at (tokens delivered before it)
    received: int = 0  # tokens this attempt has delivered
    broken: bool = False  # tokens went missing: nothing more of this attempt is delivered

    def needs(self, worker_id: str) -> bool:
        """Does this attempt still depend on `worker_id`? A prefill worker's part ends with
        its transfer: once a second token arrives, the decode worker has the whole KV."""
        return not (worker_id == self.prefill_worker and self.received > 1)

    def offer(self, chunk: TokenChunk) -> None:
        """Queue `chunk` minus any tokens already delivered; a gap fails the attempt."""
        if self.broken:
            return
        repeated = self.next_index - chunk.index
        if repeated > 0:
            if repeated >= len(chunk.token_ids) and chunk.token_ids:
                return
            chunk = dataclasses.replace(
                chunk,
                index=self.next_index,
                token_ids=chunk.token_ids[repeated:],
                logprobs=chunk.logprobs[repeated:],
            )
        elif repeated < 0:
            lost = f"tokens {self.next_index}..{chunk.index - 1} were lost on the way"
            log.warning("%s: %s", self.request_id, lost)
            self.broken = True
            self.fail(lost)
            return
        self.next_index = chunk.index + len(chunk.token_ids)
        self.received += len(chunk.token_ids)
        self.queue.put_nowait(chunk)

    def fail(self, error: str) -> None:
        self.queue.put_nowait(TokenChunk(self.request_id, self.next_index, [], error=error))


class TokenStreams:
    def __init__(self, bus: Bus, subjects: Subjects, gateway_id: str) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gateway_id = gateway_id
        self.open: dict[str, RequestStream] = {}
        self.subscriptions: list[Subscription] = []

    async def start(self) -> None:
        self.subscriptions = [
            await self.bus.subscribe(
                self.subjects.tokens(self.gateway_id), TokenChunk, self._on_chunk
            ),
            await self.bus.subscribe(
                self.subjects.events, (RequestFailed, WorkerLost), self._on_event
            ),
        ]
        await self.bus.nc.flush()

    async def stop(self) -> None:
        for subscription in self.subscriptions:
            await subscription.unsubscribe()
        self.subscriptions = []

    def open_stream(self, request_id: str, first_index: int = 0) -> RequestStream:
        """`first_index`: the attempt's first output position (a migrated attempt's chunks
        go on from the tokens delivered before it)."""
        stream = RequestStream(request_id, next_index=first_index, first_index=first_index)
        self.open[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self.open.pop(request_id, None)

    async def _on_chunk(self, chunk: TokenChunk, headers: Headers) -> None:
        stream = self.open.get(chunk.request_id)
        if stream is not None:  # else: a late chunk of a finished or cancelled request
            stream.offer(chunk)

    async def _on_event(self, event: RequestFailed | WorkerLost, headers: Headers) -> None:
        if isinstance(event, RequestFailed):
            failures = {event.request_id: f"request failed: {event.error}"}
            lost = ""
        else:
            failures = {r: f"worker {event.worker_id} was lost" for r in event.request_ids}
            lost = event.worker_id
        for request_id, error in failures.items():
            stream = self.open.get(request_id)
            if stream is not None and (not lost or stream.needs(lost)):
                stream.fail(error)
