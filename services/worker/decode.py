"""The decode side of a worker. A request passes through, in order (requests.py):

RESERVED (`Reserve`: blocks held for the prompt; the answer lists the transports it takes)
→ RECEIVING (`nats`: `KVChunk`s checked, then written into the reserved blocks beside the
running steps, until `KVDone`; `nixl`: a `KVReady` checked, then one READ of the prefill
worker's blocks straight into the reserved ones) → RUNNING (in the continuous batch, every
step's tokens streamed to the gateway) → finished.
A `DecodeTask` (the decode worker prefills itself) goes QUEUED → RUNNING instead.

The blocks of a reservation are freed at once by a `Cancel`, a `KVDone` that is not OK, a
`WorkerLost` naming the request (its prefill worker died), or its transfer deadline: no
first chunk within `reservation_timeout`, or no next chunk within `transfer_timeout`
(never past the request's own deadline).
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry.context import Context

from services.worker.context import WorkerContext, loop_deadline
from services.worker.requests import RequestState, WorkerRequest
from shared.engine.errors import InvalidRequest, UnknownRequest
from shared.engine.outputs import RequestOutput
from shared.kvtransfer import from_chunk
from shared.kvtransfer.transfer import read_blocks
from shared.protocol import (
    DecodeTask,
    KVChunk,
    KVDone,
    KVReady,
    Outcome,
    Reservation,
    Reserve,
    TaskAck,
)
from shared.telemetry.tracing import Headers, extract

S = RequestState
RECEIVES = (S.RESERVED, S.RECEIVING)


class DecodeSide:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    async def on_reserve(self, msg: Reserve, parent: Context) -> Reservation:
        ctx, request = self.ctx, msg.request

        async def take(entry: WorkerRequest) -> None:
            reservation = await ctx.engine.kv.reserve(request)
            entry.num_blocks = len(reservation.block_ids)
            entry.skip_blocks = reservation.num_cached_blocks
            entry.next_index += 1  # the first token comes from the prefill worker

        entry, outcome, error = await ctx.admit(
            request,
            S.RESERVED,
            parent,
            take,
            decodes=True,
            deadline_limit=ctx.config.reservation_timeout,
        )
        if entry is None:
            return Reservation(request.request_id, outcome, error=error)
        return Reservation(
            request.request_id,
            Outcome.OK,
            entry.num_blocks,
            entry.skip_blocks,
            transports=list(ctx.transports),
        )

    async def on_chunk(self, chunk: KVChunk, headers: Headers) -> None:
        """Check and write one chunk; raising refuses it (the sender fails the transfer)."""
        entry = self._receiving(chunk.request_id)
        blocks = from_chunk(chunk, self.ctx.layout, entry.num_blocks)
        if entry.state == S.RESERVED:
            self.ctx.table.move(entry, S.RECEIVING, time.time())
        copier = self.ctx.engine.kv.copier
        assert copier is not None
        await copier.write(chunk.request_id, blocks)
        entry.deadline = loop_deadline(entry.request.deadline, self.ctx.config.transfer_timeout)
        if chunk.layer_start == 0:  # the first layer group carries every block once
            self.ctx.kv_blocks_received += len(chunk.block_hashes)
            entry.trace.kv_blocks += len(chunk.block_hashes)
        entry.trace.kv_bytes += len(chunk.data)

    async def on_done(self, done: KVDone, headers: Headers) -> None:
        entry = self._receiving(done.request_id)
        entry.trace.parent = extract(headers)  # the sender's span: parent of the receiving one
        if not done.ok:
            self.ctx.engine.abort(done.request_id)
            self.ctx.table.end(entry, done.error or done.outcome.name.lower(), time.time())
            return
        entry.deadline = loop_deadline(entry.request.deadline)
        self.ctx.table.move(entry, S.RUNNING, time.time())
        self.ctx.engine.kv.start_decode(done.request_id, done.first_token_id, b"")

    async def on_ready(self, ready: KVReady, headers: Headers) -> None:
        """A one-sided transfer: check what the prefill worker offers against this worker's
        cache and the reservation, READ it into the reserved blocks, then decode. Raising
        refuses it (the prefill worker fails the request; its gateway migrates it)."""
        ctx, request_id = self.ctx, ready.request_id
        entry = self._receiving(request_id)
        try:
            local_blocks = self._check_ready(entry, ready)
            transport = ctx.transport
            assert transport is not None  # checked
            entry.transport = transport.name
            entry.trace.parent = extract(headers)
            ctx.table.move(entry, S.RECEIVING, time.time())
            if local_blocks:
                try:
                    transport.connect(ready.agent, ready.agent_metadata, ready.num_cache_blocks)
                except ValueError as exc:
                    raise InvalidRequest("agent_metadata", str(exc)) from None
                read_by = loop_deadline(ready.read_by)
                entry.kv_read = asyncio.current_task()  # a stop cancels it: the READ is aborted
                async with ctx.engine.kv.pinned(request_id):  # an abort waits for the READ
                    await read_blocks(
                        transport, ready.agent, ready.block_ids, local_blocks, read_by
                    )
                entry.kv_read = None
        except Exception as exc:
            if ctx.table.get(request_id) is entry:
                ctx.engine.abort(request_id)
                ctx.table.end(entry, f"kv transfer failed: {exc}", time.time())
            raise
        if ctx.table.get(request_id) is not entry:  # cancelled while the READ ran
            return
        entry.trace.kv_blocks = len(local_blocks)
        entry.trace.kv_bytes = len(local_blocks) * ctx.layout.block_bytes * ctx.layout.num_layers
        ctx.kv_blocks_received += len(local_blocks)
        entry.deadline = loop_deadline(entry.request.deadline)
        ctx.table.move(entry, S.RUNNING, time.time())
        ctx.engine.kv.start_decode(request_id, ready.first_token_id, ready.engine_params)

    def _check_ready(self, entry: WorkerRequest, ready: KVReady) -> list[int]:
        """The reserved block ids the offered blocks go to, after every check (InvalidRequest
        before any byte moves)."""
        transport, layout = self.ctx.transport, self.ctx.layout
        if transport is None or ready.transport != transport.name:
            raise InvalidRequest("transport", f"this worker takes no KV by {ready.transport!r}")
        expected = [layout.num_layers, *layout.block_shape]
        if ready.layout != expected or ready.dtype != layout.dtype:
            reason = f"{ready.layout} {ready.dtype} is not this worker's {expected} {layout.dtype}"
            raise InvalidRequest("layout", reason)
        offered = range(ready.first_block, ready.first_block + len(ready.block_ids))
        if offered != range(entry.skip_blocks, entry.num_blocks):
            reason = f"blocks {offered} offered, [{entry.skip_blocks}, {entry.num_blocks}) due"
            raise InvalidRequest("block_ids", reason)
        if len(ready.block_hashes) != len(ready.block_ids):
            raise InvalidRequest("block_hashes", "one hash per block")
        if any(not 0 <= b < ready.num_cache_blocks for b in ready.block_ids):
            raise InvalidRequest("block_ids", f"ids outside [0, {ready.num_cache_blocks})")
        return self.ctx.engine.kv.reserved(entry.request_id, ready.first_block, ready.block_hashes)

    async def on_task(self, task: DecodeTask, parent: Context) -> TaskAck:
        async def take(entry: WorkerRequest) -> None:
            await self.ctx.engine.submit(task.request, hold_kv=False)

        _, outcome, error = await self.ctx.admit(task.request, S.QUEUED, parent, take, decodes=True)
        return TaskAck(task.request.request_id, outcome, error)

    def on_output(self, entry: WorkerRequest, output: RequestOutput) -> None:
        """New tokens of a running request (on the loop): queue them for the gateway."""
        self.ctx.stream(entry, output)
        if output.finish_reason is not None:
            self.ctx.table.end(entry, output.finish_reason.name.lower(), time.time())

    def stop(self, entry: WorkerRequest, reason: str, *, tell_gateway: bool) -> None:
        """Abort the request (its blocks are freed once no import or READ of them runs; a
        READ in flight is abandoned at once: its source may be dead)."""
        if entry.kv_read is not None:
            entry.kv_read.cancel()
        self.ctx.engine.abort(entry.request_id)
        if tell_gateway:
            self.ctx.fail(entry, reason)
        else:
            self.ctx.table.end(entry, reason, time.time())

    def _receiving(self, request_id: str) -> WorkerRequest:
        entry = self.ctx.table.get(request_id)
        if entry is None or entry.state not in RECEIVES:
            raise UnknownRequest(f"no reservation for {request_id!r}")
        return entry
