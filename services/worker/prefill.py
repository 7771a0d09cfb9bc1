"""The prefill side of a worker. A request passes through, in order:

waiting (engine queue) → running (chunked prefill in the batch) → held (first token sampled
and streamed to the gateway; KV kept) → transferring (KV chunks to the decode worker) →
released (blocks freed). A request that finishes at its first token skips the transfer and
tells the decode worker to drop its reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.worker.context import (
    WorkerContext,
    admit,
    error_chunk,
    loop_deadline,
    token_chunk,
)
from services.worker.telemetry import WorkerTelemetry
from shared.engine.outputs import RequestOutput
from shared.kvtransfer import to_chunks
from shared.kvtransfer.nats_transport import KVSender, TransferError
from shared.protocol import KVDone, PrefillTask, TaskAck
from shared.telemetry.tracing import inject

log = logging.getLogger(__name__)


class PrefillSide:
    def __init__(self, ctx: WorkerContext, telemetry: WorkerTelemetry) -> None:
        self.ctx = ctx
        self.telemetry = telemetry
        self.computing: dict[str, PrefillTask] = {}  # waiting or running in the engine
        self.transferring: set[str] = set()  # held: first token out, KV on its way
        self.cancelled: set[str] = set()  # cancelled mid-transfer: no error to the gateway
        self.tasks: set[asyncio.Task[None]] = set()  # first token + transfer, one per request

    @property
    def busy(self) -> bool:
        return bool(self.computing or self.transferring)

    async def on_task(self, task: PrefillTask, headers: dict[str, str]) -> TaskAck:
        request = task.request
        if self.ctx.draining:
            return TaskAck(request.request_id, ok=False, error="draining")
        if request.request_id in self.computing or request.request_id in self.transferring:
            return TaskAck(request.request_id, ok=False, error="duplicate request id")
        self.computing[request.request_id] = task  # before the engine can emit its output
        self.telemetry.queue(request.request_id, "prefill", headers)
        try:
            await self.ctx.engine.call(admit(request, hold_kv=True))
        except ValueError as exc:
            del self.computing[request.request_id]
            self.telemetry.forget(request.request_id)
            return TaskAck(request.request_id, ok=False, error=str(exc), invalid=True)
        return TaskAck(request.request_id, ok=True)

    def on_output(self, output: RequestOutput) -> None:
        """The first token is out (called on the loop): stream it, then move the KV."""
        self.transferring.add(output.request_id)
        task = asyncio.create_task(self._hand_off(self.computing.pop(output.request_id), output))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def cancel(self, request_id: str) -> None:
        self.telemetry.forget(request_id)
        if request_id in self.transferring:
            self.cancelled.add(request_id)
        if self.computing.pop(request_id, None) or request_id in self.transferring:
            await self.ctx.engine.call(lambda e: e.abort_request(request_id))

    async def expire(self) -> None:
        """Fail requests still queued or computing past their deadline (a transfer has its own)."""
        for request_id, task in list(self.computing.items()):
            if loop_deadline(task.request.deadline) <= asyncio.get_running_loop().time():
                await self.cancel(request_id)
                gateway = self.ctx.subjects.tokens(task.request.gateway_id)
                index = len(task.request.delivered_token_ids)
                await self.ctx.bus.publish(gateway, error_chunk(request_id, index, "deadline"))

    async def _hand_off(self, task: PrefillTask, output: RequestOutput) -> None:
        request = task.request
        ctx = self.ctx
        index = len(request.delivered_token_ids)
        first_token = output.new_token_ids[0]
        deadline = loop_deadline(request.deadline, ctx.config.transfer_timeout)
        sender = KVSender(
            ctx.bus, ctx.subjects.kv(task.decode_worker), ctx.config.kv_window, deadline
        )
        try:
            await ctx.bus.publish(
                ctx.subjects.tokens(request.gateway_id), token_chunk(output, index)
            )
            if output.finish_reason is not None:
                done = KVDone(request.request_id, 0, first_token, ok=False, error="finished")
                await sender.abort(done)
                return
            await self._transfer(task, sender, first_token)
        finally:
            self.telemetry.after_prefill.pop(request.request_id, None)
            self.transferring.discard(request.request_id)
            self.cancelled.discard(request.request_id)

    async def _transfer(self, task: PrefillTask, sender: KVSender, first_token: int) -> None:
        """Ship the blocks decode lacks, layer group by layer group, then KVDone; release."""
        request, ctx = task.request, self.ctx
        request_id = request.request_id
        layout = ctx.layout
        num_tokens = len(request.prompt_token_ids) + len(request.delivered_token_ids)
        num_blocks = -(-num_tokens // layout.block_size) - task.skip_blocks
        max_bytes = ctx.bus.max_payload - ctx.config.kv_headroom
        group = max(1, max_bytes // max(1, num_blocks * layout.block_bytes))
        num_bytes = max(0, num_blocks) * layout.block_bytes * layout.num_layers
        span = self.telemetry.start_send(request_id, max(0, num_blocks), num_bytes)
        sender.headers = inject(span)
        started = time.perf_counter()
        try:
            for start in range(0, layout.num_layers if num_blocks > 0 else 0, group):
                layers = range(start, min(layout.num_layers, start + group))
                blocks = await ctx.engine.call(
                    lambda e, layers=layers: e.export_kv(request_id, layers, task.skip_blocks)
                )
                for chunk in to_chunks(blocks, max_bytes, sender.num_chunks):
                    await sender.send(chunk)
            done = KVDone(request_id, sender.num_chunks, first_token)
            await sender.finish(done)
            ctx.kv_blocks_sent += max(0, num_blocks)
            seconds = time.perf_counter() - started
            self.telemetry.end_send(span, seconds, num_bytes)
            megabytes = num_bytes / 1e6
            log.info(
                "%s: KV transfer of %d blocks, %.1f MB in %.1f ms (%.0f MB/s)",
                request_id,
                num_blocks,
                megabytes,
                seconds * 1e3,
                megabytes / max(seconds, 1e-9),
            )
            await ctx.engine.call(lambda e: e.release(request_id))
        except (TransferError, KeyError, ValueError) as exc:
            reason = "cancelled" if request_id in self.cancelled else str(exc)
            log.warning("%s: KV transfer failed: %s", request_id, reason)
            self.telemetry.end_send(span, time.perf_counter() - started, 0, reason)
            await ctx.engine.call(lambda e: e.abort_request(request_id))
            await sender.abort(KVDone(request_id, sender.num_chunks, first_token, False, reason))
            if request_id not in self.cancelled:
                index = len(request.delivered_token_ids) + 1
                gateway = ctx.subjects.tokens(request.gateway_id)
                await ctx.bus.publish(gateway, error_chunk(request_id, index, reason))
