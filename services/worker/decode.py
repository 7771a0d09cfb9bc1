"""The decode side of a worker. A request passes through, in order (requests.py):

RESERVED (`Reserve`: blocks held for the prompt; the answer lists the transports it takes)
→ RECEIVING (its transfer's receiver has taken a first message and bytes are moving: chunks
written beside the running steps, or one READ straight into the reserved blocks) → ENGINE
(every block is in: in the engine's continuous batch, every step's tokens streamed to the
gateway) → finished. A `DecodeTask` (the decode worker prefills itself) is ENGINE at once.

The transfer itself is the receiver's (shared/kvtransfer, picked by the first message of
the transfer); this side only follows its states (`on_receive`). A reservation ends at
once on a `Cancel`, a failed transfer (a `KVDone` that is not OK, a failed READ), a
`WorkerLost` naming the request (its prefill worker died), or its transfer deadline: no
first message within `reservation_timeout`, or no next one within `transfer_timeout`
(never past the request's own deadline). Its blocks are freed then, or, while a READ into
them is in flight, once that READ has ended: NIXL cannot stop one (transfer.read_blocks).
"""

from __future__ import annotations

import time

from opentelemetry.context import Context

from services.worker.context import WorkerContext, loop_deadline
from services.worker.requests import RECEIVES, RequestState, WorkerRequest
from shared.engine.errors import UnknownRequest
from shared.engine.outputs import RequestOutput
from shared.kvtransfer.transfer import Awaiting, TransferState
from shared.protocol import DecodeTask, Outcome, Reservation, Reserve, SubmitRequest, TaskAck
from shared.telemetry.tracing import extract

S = RequestState


class DecodeSide:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    async def on_reserve(self, msg: Reserve, parent: Context) -> Reservation:
        ctx, request = self.ctx, msg.request
        if (held := self.held_reservation(request)) is not None:
            return held

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
        return self.granted(entry)

    def held_reservation(self, request: SubmitRequest) -> Reservation | None:
        """The reservation this worker already holds for the same attempt of `request`:
        a scheduler that lost the first answer (a timeout, the worker briefly taken for
        lost) asks again and gets it back, rather than a refusal while it lives on."""
        entry = self.ctx.table.get(request.request_id)
        if entry is None or entry.state != S.RESERVED:
            return None
        same = (entry.request.attempt, entry.request.gateway_id)
        return self.granted(entry) if same == (request.attempt, request.gateway_id) else None

    def granted(self, entry: WorkerRequest) -> Reservation:
        return Reservation(
            entry.request_id,
            Outcome.OK,
            entry.num_blocks,
            entry.skip_blocks,
            transports=self.ctx.link.names,
            epoch=self.ctx.link.epoch,
        )

    async def on_task(self, task: DecodeTask, parent: Context) -> TaskAck:
        async def take(entry: WorkerRequest) -> None:
            await self.ctx.read_prefix(task.request, task.prefix_peer)
            await self.ctx.engine.submit(task.request, hold_kv=False)

        _, outcome, error = await self.ctx.admit(task.request, S.ENGINE, parent, take, decodes=True)
        return TaskAck(task.request.request_id, outcome, error)

    # -- ReceiveEvents: the transfer's receiver ------------------------------------------------
    def awaiting(self, request_id: str) -> Awaiting:
        entry = self.ctx.table.get(request_id)
        if entry is None or entry.state not in RECEIVES:
            raise UnknownRequest(f"no reservation for {request_id!r}")
        return entry

    def on_receive(self, request: Awaiting, state: TransferState) -> None:
        ctx, entry = self.ctx, self.ctx.table.get(request.request_id)
        if entry is not request or entry.receiver is None:  # stopped meanwhile
            return
        received = entry.receiver.received
        entry.transport = entry.receiver.name
        ctx.kv_blocks_received += received.num_blocks - entry.trace.kv_blocks
        entry.trace.kv_blocks, entry.trace.kv_bytes = received.num_blocks, received.num_bytes
        if state == TransferState.TRANSFERRING:
            if entry.state == S.RESERVED:
                ctx.table.move(entry, S.RECEIVING, time.time())
            entry.deadline = loop_deadline(entry.request.deadline, ctx.config.transfer_timeout)
            return
        entry.trace.parent = extract(received.headers)  # the sender's span: parent of ours
        if state == TransferState.FAILED:
            ctx.engine.abort(entry.request_id)
            ctx.table.end(entry, received.error, time.time())
            return
        entry.deadline = loop_deadline(entry.request.deadline)
        ctx.table.move(entry, S.ENGINE, time.time())
        ctx.engine.kv.start_decode(
            entry.request_id, received.first_token_id, received.engine_params
        )

    # -- the engine's steps ----------------------------------------------------------------------
    def on_output(self, entry: WorkerRequest, output: RequestOutput) -> None:
        """New tokens of a running request (on the loop): queue them for the gateway."""
        self.ctx.stream(entry, output)
        if output.finish_reason is not None:
            self.ctx.table.end(entry, output.finish_reason.name.lower(), time.time())

    def stop(self, entry: WorkerRequest, reason: str, *, tell_gateway: bool) -> None:
        """Abort the request at once (its source may be dead); its blocks are freed once no
        write or READ into them runs, a READ in flight having ended (transfer.read_blocks)."""
        if entry.receiver is not None:
            entry.receiver.abort()
        self.ctx.engine.abort(entry.request_id)
        if tell_gateway:
            self.ctx.fail(entry, reason)
        else:
            self.ctx.table.end(entry, reason, time.time())
