"""The `nats` KV transport: chunks as request/reply on the decode worker's KV subject.

`KVSender` keeps up to `window` chunks unacknowledged (flow control) and fails the whole
transfer on the first refused chunk, timeout or passed deadline. `serve_kv` answers both
message kinds of the subject with a `TaskAck`; a handler's error becomes its outcome: a
frame or block that does not fit is INVALID, a request the receiver does not hold
UNAVAILABLE, anything else FAILED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.bus import Bus, Headers
from shared.engine.errors import EngineError, UnknownRequest
from shared.kvtransfer.chunks import BadChunk
from shared.protocol import KVChunk, KVDone, Outcome, TaskAck, WireError, decode_one_of, encode

log = logging.getLogger(__name__)

ChunkHandler = Callable[[KVChunk, Headers], Awaitable[None]]
DoneHandler = Callable[[KVDone, Headers], Awaitable[None]]


class TransferError(RuntimeError):
    """A KV transfer that cannot complete: refused chunk, timeout or deadline."""


class KVSender:
    def __init__(
        self, bus: Bus, subject: str, window: int, deadline: float, headers: Headers | None = None
    ) -> None:
        """`deadline` is on the event loop's clock (`loop.time()`); `headers` (the trace
        context) go with every chunk and the KVDone."""
        self.bus = bus
        self.headers = headers
        self.subject = subject
        self.window = window
        self.deadline = deadline
        self.num_chunks = 0
        self.num_blocks = 0  # blocks carried, counted once per layer group
        self._pending: set[asyncio.Task[None]] = set()

    async def send(self, chunk: KVChunk) -> None:
        """Queue `chunk`; waits while `window` chunks are unacknowledged."""
        while len(self._pending) >= self.window:
            await self._wait_one()
        self._pending.add(asyncio.create_task(self._request(chunk)))
        self.num_chunks += 1
        if chunk.layer_start == 0:
            self.num_blocks += len(chunk.block_hashes)

    async def finish(self, done: KVDone) -> None:
        """Wait for every chunk's ack, then send `done`."""
        while self._pending:
            await self._wait_one()
        await self._request(done)

    async def abort(self, done: KVDone, timeout: float = 1.0) -> None:
        """Drop unacknowledged chunks and tell the receiver (best effort) to drop the request."""
        for task in self._pending:
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending.clear()
        try:
            await self.bus.request(self.subject, done, TaskAck, timeout, self.headers)
        except Exception as exc:  # the receiver's own deadline cleans up
            log.info("%s: could not send KVDone(%s): %s", done.request_id, done.outcome.name, exc)

    async def _wait_one(self) -> None:
        finished, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            self._pending.discard(task)
            task.result()

    async def _request(self, message: KVChunk | KVDone) -> None:
        remaining = self.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise TransferError("KV transfer deadline passed")
        try:
            ack = await self.bus.request(self.subject, message, TaskAck, remaining, self.headers)
        except TimeoutError:
            raise TransferError("KV transfer timed out") from None
        except Exception as exc:  # no responders, connection lost, bad reply
            raise TransferError(f"KV transfer failed: {exc}") from exc
        if not ack.ok:
            raise TransferError(f"decode worker refused KV: {ack.error}")


async def serve_kv(
    bus: Bus, subject: str, on_chunk: ChunkHandler, on_done: DoneHandler
) -> Subscription:
    """Answer `KVChunk` and `KVDone` requests on `subject` with a `TaskAck`."""

    async def on_message(msg: Msg) -> None:
        request_id = ""
        try:
            message = decode_one_of(msg.data, KVChunk, KVDone)
            request_id = message.request_id
            if isinstance(message, KVChunk):
                await on_chunk(message, msg.headers or {})
            else:
                await on_done(message, msg.headers or {})
            ack = TaskAck(request_id, Outcome.OK)
        except (WireError, BadChunk, EngineError) as exc:
            log.warning("refused KV on %s: %s", msg.subject, exc)
            unknown = isinstance(exc, UnknownRequest)
            ack = TaskAck(request_id, Outcome.UNAVAILABLE if unknown else Outcome.INVALID, str(exc))
        except Exception as exc:
            log.exception("KV handler on %s failed", msg.subject)
            ack = TaskAck(request_id, Outcome.FAILED, f"internal error: {exc}")
        if msg.reply:
            await msg.respond(encode(ack))

    return await bus.nc.subscribe(subject, cb=on_message)
