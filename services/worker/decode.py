"""The decode side of a worker. A request passes through, in order:

reserved (blocks held for the prompt; `Reserve`) → receiving (`KVChunk`s written into the
reserved blocks) → running (after `KVDone`: in the continuous batch, every step's tokens
streamed to the gateway) → finished (blocks freed). A `DecodeTask` enters the engine's
waiting queue instead and is prefilled here. The blocks of a reservation are freed at once
by a `Cancel`, a `KVDone(ok=False)`, a `WorkerLost` naming the request (its prefill worker
died), or its transfer deadline: no first chunk within `reservation_timeout`, or no next
chunk within `transfer_timeout` (never past the request's own deadline).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.worker.context import (
    WorkerContext,
    admit,
    error_chunk,
    loop_deadline,
    token_chunk,
)
from services.worker.telemetry import WorkerTelemetry
from shared.engine.kv_handoff import OutOfBlocks
from shared.engine.outputs import RequestOutput
from shared.kvtransfer import from_chunk
from shared.protocol import (
    DecodeTask,
    KVChunk,
    KVDone,
    Reservation,
    Reserve,
    SubmitRequest,
    TaskAck,
    TokenChunk,
)


@dataclass(slots=True)
class Reserved:
    request: SubmitRequest
    num_blocks: int
    deadline: float  # loop clock: the transfer deadline, pushed on by every chunk


@dataclass(slots=True)
class Stream:
    subject: str  # the gateway's token subject
    next_index: int  # output position of the next token
    deadline: float  # loop clock


class DecodeSide:
    def __init__(self, ctx: WorkerContext, telemetry: WorkerTelemetry) -> None:
        self.ctx = ctx
        self.telemetry = telemetry
        self.reserved: dict[str, Reserved] = {}  # reserved or receiving
        self.streams: dict[str, Stream] = {}  # running (or queued, for a DecodeTask)
        self.outbox: asyncio.Queue[tuple[str, TokenChunk]] = asyncio.Queue()  # to gateways

    @property
    def busy(self) -> bool:
        return bool(self.reserved or self.streams or not self.outbox.empty())

    async def on_reserve(self, msg: Reserve, headers: dict[str, str]) -> Reservation:
        if self.ctx.draining:
            return Reservation(msg.request_id, ok=False, error="draining")
        try:
            request = msg.request
            reservation = await self.ctx.engine.call(
                lambda e: e.reserve(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling,
                    output_token_ids=request.delivered_token_ids,
                )
            )
        except (OutOfBlocks, ValueError) as exc:
            invalid = isinstance(exc, ValueError)  # engine validation; OutOfBlocks is room
            return Reservation(msg.request_id, ok=False, error=str(exc), invalid=invalid)
        num_blocks = len(reservation.block_ids)
        deadline = loop_deadline(msg.request.deadline, self.ctx.config.reservation_timeout)
        self.reserved[msg.request_id] = Reserved(msg.request, num_blocks, deadline)
        return Reservation(msg.request_id, True, num_blocks, reservation.num_cached_blocks)

    async def on_chunk(self, chunk: KVChunk, headers: dict[str, str]) -> None:
        """Validate and write one chunk; raising refuses it (the sender fails the transfer)."""
        reserved = self.reserved.get(chunk.request_id)
        if reserved is None:
            raise KeyError(f"no reservation for {chunk.request_id!r}")
        blocks = from_chunk(chunk, self.ctx.layout, reserved.num_blocks)
        await self.ctx.engine.call(lambda e: e.import_kv(chunk.request_id, blocks))
        reserved.deadline = loop_deadline(
            reserved.request.deadline, self.ctx.config.transfer_timeout
        )
        if chunk.layer_start == 0:  # the first layer group carries every block once
            self.ctx.kv_blocks_received += len(chunk.block_hashes)
        blocks_once = len(chunk.block_hashes) if chunk.layer_start == 0 else 0
        self.telemetry.on_chunk(chunk.request_id, blocks_once, len(chunk.data))

    async def on_done(self, done: KVDone, headers: dict[str, str]) -> None:
        request_id = done.request_id
        reserved = self.reserved.pop(request_id, None)
        if reserved is None:
            raise KeyError(f"no reservation for {request_id!r}")
        request = reserved.request
        self.telemetry.on_done(request_id, headers, "" if done.ok else done.error or "failed")
        if not done.ok:
            await self.ctx.engine.call(lambda e: e.abort_request(request_id))
            return
        subject = self.ctx.subjects.tokens(request.gateway_id)
        index = len(request.delivered_token_ids) + 1  # the first token came from prefill
        self.streams[request_id] = Stream(subject, index, loop_deadline(request.deadline))
        try:
            await self.ctx.engine.call(lambda e: e.start_decode(request_id, done.first_token_id))
        except (KeyError, ValueError):
            self.streams.pop(request_id, None)
            self.telemetry.forget(request_id)
            await self.ctx.engine.call(lambda e: e.abort_request(request_id))
            raise

    async def on_task(self, task: DecodeTask, headers: dict[str, str]) -> TaskAck:
        request = task.request
        if self.ctx.draining:
            return TaskAck(request.request_id, ok=False, error="draining")
        subject = self.ctx.subjects.tokens(request.gateway_id)
        index = len(request.delivered_token_ids)
        self.streams[request.request_id] = Stream(subject, index, loop_deadline(request.deadline))
        self.telemetry.queue(request.request_id, "decode", headers)
        try:
            await self.ctx.engine.call(admit(request))
        except ValueError as exc:
            self.streams.pop(request.request_id, None)
            self.telemetry.forget(request.request_id)
            return TaskAck(request.request_id, ok=False, error=str(exc), invalid=True)
        return TaskAck(request.request_id, ok=True)

    def on_output(self, output: RequestOutput) -> None:
        """New tokens of a running request (called on the loop): queue them for the gateway."""
        stream = self.streams.get(output.request_id)
        if stream is None:  # cancelled while the step ran
            return
        self.outbox.put_nowait((stream.subject, token_chunk(output, stream.next_index)))
        stream.next_index += len(output.new_token_ids)
        if output.finish_reason is not None:
            del self.streams[output.request_id]

    async def publish_tokens(self) -> None:
        """Forever: publish queued token chunks in order."""
        while True:
            subject, chunk = await self.outbox.get()
            await self.ctx.bus.publish(subject, chunk)
            self.outbox.task_done()

    async def cancel(self, request_id: str) -> None:
        self.telemetry.forget(request_id)
        reserved = self.reserved.pop(request_id, None)
        if reserved is not None or self.streams.pop(request_id, None) is not None:
            await self.ctx.engine.call(lambda e: e.abort_request(request_id))

    async def on_worker_lost(self, request_ids: list[str]) -> None:
        """A prefill worker died: free the reservations it would have filled (a request
        already decoding has its whole KV here and goes on)."""
        for request_id in request_ids:
            if request_id in self.reserved:
                await self.cancel(request_id)

    async def expire(self) -> None:
        """Drop reservations whose KV stopped coming and fail streams past their deadline."""
        now = asyncio.get_running_loop().time()
        for request_id, reserved in list(self.reserved.items()):
            if reserved.deadline <= now:
                await self.cancel(request_id)
        for request_id, stream in list(self.streams.items()):
            if stream.deadline <= now:
                await self.cancel(request_id)
                chunk = error_chunk(request_id, stream.next_index, "deadline")
                self.outbox.put_nowait((stream.subject, chunk))
