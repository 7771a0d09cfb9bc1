"""The `nats` KV transport: chunks as request/reply on the decode worker's KV subject.

`ChunkSender` keeps up to `window` chunks unacknowledged (flow control) and fails the whole
transfer on the first refused chunk, timeout or passed deadline; every transport sends its
control messages (`KVReady`, `KVDone`) through one too. `NatsSender` exports a held
request's blocks in one copy and sends them as chunks under max_payload, then `KVDone`;
`NatsReceiver` checks each chunk and writes it into the reservation beside the running
steps, until `KVDone`. `serve_kv` answers every message kind of the decode worker's KV
subject with a `TaskAck`; a handler's error becomes its outcome: a frame or block that does
not fit is INVALID, a request the receiver does not hold UNAVAILABLE, a failed transfer or
anything else FAILED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Protocol

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.bus import Bus, Headers
from shared.engine.errors import EngineError, InvalidRequest, UnknownRequest
from shared.engine.kv_handoff import HeldBlocks
from shared.kvtransfer.chunks import BadChunk, KVLayout, from_chunk, to_chunks
from shared.kvtransfer.transfer import (
    Awaiting,
    KVCopier,
    KVMessage,
    Received,
    ReceiveEvents,
    TransferError,
    TransferState,
)
from shared.protocol import (
    KVChunk,
    KVDone,
    KVReady,
    Outcome,
    TaskAck,
    WireError,
    encode,
)
from shared.wire_checks import decode_checked_one_of

log = logging.getLogger(__name__)


class ChunkSender:
    def __init__(
        self,
        bus: Bus,
        subject: str,
        window: int,
        deadline: float,
        headers: Headers | None = None,
        epochs: tuple[int, int] = (0, 0),
    ) -> None:
        """`deadline` is on the event loop's clock (`loop.time()`); `headers` (the trace
        context) go with every chunk and the KVDone; `epochs` (this process's, the receiving
        one's: shared/epoch.py) are stamped on every message."""
        self.bus = bus
        self.epochs = epochs
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

    async def finish(self, done: KVDone | KVReady) -> None:
        """Wait for every chunk's ack, then send `done` (or a one-sided transfer's `KVReady`)
        and wait for its ack."""
        while self._pending:
            await self._wait_one()
        await self._request(done)

    async def abort(self, done: KVDone, timeout: float = 1.0) -> None:
        """Drop unacknowledged chunks and tell the receiver (best effort) to drop the request."""
        for task in self._pending:
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending.clear()
        done.epoch, done.to_epoch = self.epochs
        try:
            await self.bus.request(self.subject, done, TaskAck, timeout, self.headers)
        except Exception as exc:  # the receiver's own deadline cleans up
            log.info("%s: could not send KVDone(%s): %s", done.request_id, done.outcome.name, exc)

    async def _wait_one(self) -> None:
        finished, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            self._pending.discard(task)
            task.result()

    async def _request(self, message: KVChunk | KVDone | KVReady) -> None:
        remaining = self.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise TransferError("KV transfer deadline passed")
        message.epoch, message.to_epoch = self.epochs
        try:
            ack = await self.bus.request(self.subject, message, TaskAck, remaining, self.headers)
        except TimeoutError:
            raise TransferError("KV transfer timed out") from None
        except Exception as exc:  # no responders, connection lost, bad reply
            raise TransferError(f"KV transfer failed: {exc}") from exc
        if not ack.ok:
            raise TransferError(f"decode worker refused KV: {ack.error}")


NO_COPIES = "this engine copies no KV blocks: no KV transport in common with the peer"


class ControlledSender:
    """What every `KVSender` shares: the request, its first token, the control channel to the
    decode worker (a `ChunkSender`, which carries the trace headers), and the poll state a
    send moves through."""

    name: str

    def __init__(self, control: ChunkSender, request_id: str, first_token_id: int) -> None:
        self.control = control
        self.request_id = request_id
        self.first_token_id = first_token_id
        self.state = TransferState.WAITING_FOR_INPUT

    @property
    def headers(self) -> Headers | None:
        return self.control.headers

    @headers.setter
    def headers(self, headers: Headers | None) -> None:
        self.control.headers = headers

    def poll(self) -> TransferState:
        return self.state

    async def abort(self, reason: str) -> None:
        self.state = TransferState.FAILED
        chunks = self.control.num_chunks
        done = KVDone(self.request_id, chunks, self.first_token_id, Outcome.FAILED, reason)
        await self.control.abort(done)

    async def _transferring(self, body: Awaitable[None]) -> None:
        """Run the send's `body` as TRANSFERRING, then SUCCESS, or FAILED when it raises."""
        self.state = TransferState.TRANSFERRING
        try:
            await body
        except BaseException:
            self.state = TransferState.FAILED
            raise
        self.state = TransferState.SUCCESS


class NatsSender(ControlledSender):
    name = "nats"

    def __init__(
        self,
        control: ChunkSender,
        request_id: str,
        first_token_id: int,
        copier: KVCopier | None,
        max_bytes: int,  # per chunk's data: the bus's max_payload less headroom
    ) -> None:
        super().__init__(control, request_id, first_token_id)
        self.copier = copier
        self.max_bytes = max_bytes

    async def send(self, first_block: int, blocks: HeldBlocks, engine_params: bytes) -> None:
        """One export of every layer, cut into chunks under `max_bytes`, then KVDone."""
        if self.copier is None:
            self.state = TransferState.FAILED
            raise TransferError(NO_COPIES)
        await self._transferring(self._push(self.copier, first_block, len(blocks.block_ids)))

    async def _push(self, copier: KVCopier, first_block: int, num_blocks: int) -> None:
        if first_block < num_blocks:
            exported = await copier.export(self.request_id, first_block)
            for chunk in to_chunks(exported, self.max_bytes):
                await self.control.send(chunk)
        await self.control.finish(
            KVDone(self.request_id, self.control.num_chunks, self.first_token_id)
        )


class NatsReceiver:
    name = "nats"

    def __init__(
        self,
        layout: KVLayout,
        copier: KVCopier | None,
        request: Awaiting,
        events: ReceiveEvents,
    ) -> None:
        self.layout = layout
        self.copier = copier
        self.request = request
        self.events = events
        self.received = Received()
        self.state = TransferState.WAITING_FOR_INPUT

    def poll(self) -> TransferState:
        return self.state

    async def on_message(self, message: KVMessage, headers: Headers) -> None:
        if isinstance(message, KVChunk):
            await self._on_chunk(message)
        elif isinstance(message, KVDone):
            self._on_done(message, headers)
        else:
            raise InvalidRequest("transport", "this transfer moves its KV over nats")

    def abort(self) -> None:
        """Nothing to stop: a chunk being written finishes before its blocks are freed."""
        self.state = TransferState.FAILED

    async def _on_chunk(self, chunk: KVChunk) -> None:
        """Check and write one chunk."""
        if self.copier is None:
            raise InvalidRequest("transport", NO_COPIES)
        blocks = from_chunk(chunk, self.layout, self.request.num_blocks)
        self._move(TransferState.TRANSFERRING)
        await self.copier.write(chunk.request_id, blocks)
        if chunk.layer_start == 0:  # the first layer group carries every block once
            self.received.num_blocks += len(chunk.block_hashes)
        self.received.num_bytes += len(chunk.data)
        self._move(TransferState.TRANSFERRING)  # again: these blocks are in

    def _on_done(self, done: KVDone, headers: Headers) -> None:
        self.received.headers = headers
        if not done.ok:
            self.received.error = done.error or done.outcome.name.lower()
            self._move(TransferState.FAILED)
            return
        self.received.first_token_id = done.first_token_id
        self._move(TransferState.SUCCESS)

    def _move(self, state: TransferState) -> None:
        self.state = state
        self.events.on_receive(self.request, state)


class KVHandlers(Protocol):
    """The decode worker's side of its KV subject: one method per message kind."""

    async def on_chunk(self, chunk: KVChunk, headers: Headers) -> None: ...

    async def on_done(self, done: KVDone, headers: Headers) -> None: ...

    async def on_ready(self, ready: KVReady, headers: Headers) -> None: ...


async def serve_kv(bus: Bus, subject: str, handlers: KVHandlers) -> Subscription:
    """Answer `KVChunk`, `KVDone` and `KVReady` requests on `subject` with a `TaskAck`, each
    in its own task (a READ takes a while; chunks of a window are independent)."""
    tasks: set[asyncio.Task[None]] = set()

    async def answer(msg: Msg) -> None:
        request_id = ""
        try:
            message = decode_checked_one_of(msg.data, KVChunk, KVDone, KVReady)
            request_id = message.request_id
            headers = msg.headers or {}
            if isinstance(message, KVChunk):
                await handlers.on_chunk(message, headers)
            elif isinstance(message, KVDone):
                await handlers.on_done(message, headers)
            else:
                await handlers.on_ready(message, headers)
            ack = TaskAck(request_id, Outcome.OK)
        except WireError as exc:
            bus.rejections.reject(msg.subject, exc)
            ack = TaskAck(request_id, Outcome.INVALID, str(exc))
        except (BadChunk, EngineError) as exc:
            log.warning("refused KV on %s: %s", msg.subject, exc)
            unknown = isinstance(exc, UnknownRequest)
            ack = TaskAck(request_id, Outcome.UNAVAILABLE if unknown else Outcome.INVALID, str(exc))
        except TransferError as exc:
            log.warning("%s: KV transfer failed: %s", request_id, exc)
            ack = TaskAck(request_id, Outcome.FAILED, str(exc))
        except Exception as exc:
            log.exception("KV handler on %s failed", msg.subject)
            ack = TaskAck(request_id, Outcome.FAILED, f"internal error: {exc}")
        if msg.reply:
            await msg.respond(encode(ack))

    async def on_message(msg: Msg) -> None:
        task = asyncio.create_task(answer(msg))
        tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(tasks.discard)

    return await bus.nc.subscribe(subject, cb=on_message)
