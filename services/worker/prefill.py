"""The prefill side of a worker. A request passes through, in order (requests.py):

QUEUED (the `PrefillTask` is acked at once: validity is checked without waiting for a step)
→ COMPUTING (its first chunk is scheduled) → HELD (first token sampled, streamed to the
gateway; KV pinned) → TRANSFERRING (`nixl`, when both ends take it: a `KVReady` naming
the blocks, which the decode worker READs straight from this worker's cache before it
answers; `nats`: all its blocks exported in one copy, sent as chunks, then `KVDone`) →
released. A request that finishes at its first token skips the transfer
and tells the decode worker to drop its reservation. A cancel while the KV is in flight
stops the transfer; the blocks are freed once no copy of them is running.
"""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry.context import Context

from services.worker.context import WorkerContext, loop_deadline
from services.worker.requests import RequestState, WorkerRequest
from shared.engine.kv_handoff import HeldBlocks
from shared.engine.outputs import RequestOutput
from shared.kvtransfer import to_chunks
from shared.kvtransfer.nats_transport import KVSender
from shared.kvtransfer.transfer import TransferError
from shared.protocol import KVDone, KVPeer, KVReady, Outcome, PrefillTask, TaskAck
from shared.telemetry.tracing import inject

log = logging.getLogger(__name__)
S = RequestState


class PeerStats:
    """What this prefill worker has sent each decode worker (heartbeats carry it)."""

    def __init__(self) -> None:
        self._peers: dict[str, KVPeer] = {}

    def sent(self, decode_worker: str, transport: str, blocks: int) -> None:
        peer = self._peers.setdefault(decode_worker, KVPeer(decode_worker, transport, 0, 0))
        peer.transport = transport
        peer.blocks += blocks
        peer.transfers += 1

    def snapshot(self) -> list[KVPeer]:
        return [
            KVPeer(p.worker_id, p.transport, p.blocks, p.transfers) for p in self._peers.values()
        ]


class PrefillSide:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.peers = PeerStats()

    async def on_task(self, task: PrefillTask, parent: Context) -> TaskAck:
        async def take(entry: WorkerRequest) -> None:
            entry.decode_worker, entry.skip_blocks = task.decode_worker, task.skip_blocks
            entry.offered_transports = list(task.transports)
            await self.ctx.engine.submit(task.request, hold_kv=True)

        _, outcome, error = await self.ctx.admit(
            task.request, S.QUEUED, parent, take, decodes=False
        )
        return TaskAck(task.request.request_id, outcome, error)

    def on_output(
        self, entry: WorkerRequest, output: RequestOutput, held: HeldBlocks | None
    ) -> None:
        """The first token (on the loop), the one place it is handled: stream it, then move
        the KV (`held`: its blocks; None when that token ended the request)."""
        entry.trace.cached_tokens = output.num_cached_tokens
        self.ctx.table.move(entry, S.HELD, time.time())
        self.ctx.stream(entry, output)
        first_token = output.new_token_ids[0]
        entry.hand_off = asyncio.create_task(self._hand_off(entry, first_token, held))

    def stop(self, entry: WorkerRequest, reason: str, *, tell_gateway: bool) -> None:
        """Abort the request; HELD or TRANSFERRING, its hand-off is cancelled and cleans up."""
        if entry.hand_off is not None:
            entry.failure = entry.failure or (reason if tell_gateway else "")
            entry.hand_off.cancel()
            return
        self.ctx.engine.abort(entry.request_id)
        if tell_gateway:
            self.ctx.fail(entry, reason)
        else:
            self.ctx.table.end(entry, reason, time.time())

    async def _hand_off(
        self, entry: WorkerRequest, first_token: int, held: HeldBlocks | None
    ) -> None:
        ctx, request_id = self.ctx, entry.request_id
        deadline = loop_deadline(entry.request.deadline, ctx.config.transfer_timeout)
        subject = ctx.subjects.kv(entry.decode_worker)
        sender = KVSender(ctx.bus, subject, ctx.config.kv_window, deadline)
        try:
            if held is None:  # the first token ended it; the engine has freed it: no KV to move
                await sender.abort(KVDone(request_id, 0, first_token, Outcome.FAILED, "finished"))
                ctx.table.end(entry, "finished", time.time())
                return
            ctx.table.move(entry, S.TRANSFERRING, time.time())
            await self._transfer(entry, sender, first_token, held)
        except asyncio.CancelledError:  # stopped: a Cancel, or a failure to report
            ctx.engine.abort(request_id)
            reason = entry.failure or "cancelled"
            if entry.failure:
                ctx.fail(entry, entry.failure)
            else:
                ctx.table.end(entry, reason, time.time())
            await sender.abort(KVDone(request_id, 0, first_token, Outcome.FAILED, reason))
        except Exception as exc:
            reason = str(exc) if isinstance(exc, TransferError) else f"internal error: {exc!r}"
            log.warning("%s: KV transfer failed: %s", request_id, reason)
            ctx.engine.abort(request_id)
            done = KVDone(request_id, sender.num_chunks, first_token, Outcome.FAILED, reason)
            await sender.abort(done)
            ctx.fail(entry, reason)
        else:
            ctx.engine.kv.release(request_id)
            ctx.table.end(entry, "finished", time.time())

    async def _transfer(
        self, entry: WorkerRequest, sender: KVSender, first_token: int, held: HeldBlocks
    ) -> None:
        """Move the blocks decode lacks by the transport both ends take, then release them."""
        ctx, request_id, layout = self.ctx, entry.request_id, self.ctx.layout
        request = entry.request
        num_tokens = len(request.prompt_token_ids) + len(request.delivered_token_ids)
        num_blocks = max(0, -(-num_tokens // layout.block_size) - entry.skip_blocks)
        num_bytes = num_blocks * layout.block_bytes * layout.num_layers
        transport = ctx.transport
        one_sided = transport is not None and transport.name in entry.offered_transports
        entry.transport = transport.name if one_sided and transport else "nats"
        span = ctx.telemetry.start_send(entry, num_blocks, num_bytes)
        sender.headers = inject(span)
        started = time.perf_counter()
        try:
            if one_sided:
                await self._offer(entry, sender, first_token, held)
            else:
                await self._push(entry, sender, first_token, num_blocks)
        except BaseException as exc:
            error = "cancelled" if isinstance(exc, asyncio.CancelledError) else str(exc)
            ctx.telemetry.end_send(entry, span, time.perf_counter() - started, 0, error)
            raise
        seconds = time.perf_counter() - started
        ctx.kv_blocks_sent += num_blocks
        self.peers.sent(entry.decode_worker, entry.transport, num_blocks)
        ctx.telemetry.end_send(entry, span, seconds, num_bytes)
        log.info(
            "%s: KV transfer (%s) of %d blocks, %.1f MB in %.1f ms (%.0f MB/s)",
            request_id,
            entry.transport,
            num_blocks,
            num_bytes / 1e6,
            seconds * 1e3,
            num_bytes / 1e6 / max(seconds, 1e-9),
        )

    async def _push(
        self, entry: WorkerRequest, sender: KVSender, first_token: int, num_blocks: int
    ) -> None:
        """`nats`: one export of every layer, cut into chunks under max_payload, then KVDone."""
        ctx, request_id = self.ctx, entry.request_id
        if num_blocks:
            copier = ctx.engine.kv.copier
            assert copier is not None
            blocks = await copier.export(request_id, entry.skip_blocks)
            max_bytes = ctx.bus.max_payload - ctx.config.kv_headroom
            for chunk in to_chunks(blocks, max_bytes):
                await sender.send(chunk)
        await sender.finish(KVDone(request_id, sender.num_chunks, first_token))

    async def _offer(
        self, entry: WorkerRequest, sender: KVSender, first_token: int, held: HeldBlocks
    ) -> None:
        """One-sided (`nixl`): tell the decode worker where the blocks are; it READs them and
        answers. The blocks stay held until then (or this side's deadline, which comes after
        the READ's own)."""
        ctx, transport, layout = self.ctx, self.ctx.transport, self.ctx.layout
        assert transport is not None
        block_ids, block_hashes = held.block_ids, held.block_hashes
        first = entry.skip_blocks
        read_for = max(0.0, sender.deadline - asyncio.get_running_loop().time()) / 2
        ready = KVReady(
            request_id=entry.request_id,
            transport=transport.name,
            agent=ctx.config.worker_id,
            agent_metadata=transport.metadata(),
            num_cache_blocks=transport.num_blocks,
            layout=[layout.num_layers, *layout.block_shape],
            dtype=layout.dtype,
            first_block=first,
            block_ids=block_ids[first:],
            block_hashes=block_hashes[first:],
            first_token_id=first_token,
            read_by=time.time() + read_for,
            engine_params=ctx.engine.kv.params(entry.request_id),
        )
        with transport.serving():
            await sender.finish(ready)
