"""The prefill side of a worker. A request passes through, in order (requests.py):

ENGINE (the `PrefillTask` is acked at once: validity is checked without waiting for a step;
queued and computed as the engine reports) → TRANSFERRING (its first token sampled, streamed
to the gateway, KV pinned: the hand-off's sender moves the blocks the decode worker lacks,
by the transport both ends take: shared/kvtransfer picks it) → released.
A request that finishes at its first token skips the transfer and tells the decode worker
to drop its reservation. A cancel while the KV is in flight stops the transfer; the blocks
are freed once no copy or READ of them is running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from opentelemetry.context import Context

from services.worker.context import WorkerContext, loop_deadline
from services.worker.requests import RequestState, WorkerRequest
from services.worker.step_costs import ALPHA
from shared.engine.kv_handoff import HeldBlocks
from shared.engine.outputs import RequestOutput
from shared.kvtransfer.transfer import KVSender, TransferError
from shared.protocol import KVPeer, PrefillTask, TaskAck
from shared.telemetry.tracing import inject

log = logging.getLogger(__name__)
S = RequestState


class PeerStats:
    """What this prefill worker has sent each decode worker (heartbeats carry it), and how
    long it took: EWMAs of each transfer's bytes and seconds (the link's bandwidth is their
    ratio), and of the seconds of transfers of at most `SMALL_BLOCKS` (the link's fixed cost:
    offer, READ set-up, answer)."""

    SMALL_BLOCKS = 1

    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self._peers: dict[str, KVPeer] = {}

    def sent(
        self, decode_worker: str, transport: str, blocks: int, num_bytes: int, seconds: float
    ) -> None:
        peer = self._peers.setdefault(decode_worker, KVPeer(decode_worker, transport, 0, 0))
        first = not peer.transfers
        peer.transport = transport
        peer.blocks += blocks
        peer.transfers += 1
        peer.mean_bytes = num_bytes if first else self._ewma(peer.mean_bytes, num_bytes)
        peer.mean_seconds = seconds if first else self._ewma(peer.mean_seconds, seconds)
        if blocks <= self.SMALL_BLOCKS:
            peer.latency = self._ewma(peer.latency, seconds) if peer.latency else seconds

    def _ewma(self, value: float, sample: float) -> float:
        return value + self.alpha * (sample - value)

    def snapshot(self) -> list[KVPeer]:
        return [dataclasses.replace(p) for p in self._peers.values()]


class PrefillSide:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.peers = PeerStats()

    async def on_task(self, task: PrefillTask, parent: Context) -> TaskAck:
        async def take(entry: WorkerRequest) -> None:
            entry.decode_worker, entry.skip_blocks = task.decode_worker, task.skip_blocks
            entry.offered_transports = list(task.transports)
            entry.decode_epoch = task.decode_epoch
            await self.ctx.read_prefix(task.request, task.prefix_peer)
            await self.ctx.engine.submit(task.request, hold_kv=True)

        _, outcome, error = await self.ctx.admit(
            task.request, S.ENGINE, parent, take, decodes=False
        )
        return TaskAck(task.request.request_id, outcome, error)

    def on_output(
        self, entry: WorkerRequest, output: RequestOutput, held: HeldBlocks | None
    ) -> None:
        """The first token (on the loop), the one place it is handled: stream it, then move
        the KV (`held`: its blocks; None when that token ended the request)."""
        now = time.time()
        self.ctx.telemetry.on_first_token(entry, output, now)
        self.ctx.table.move(entry, S.TRANSFERRING, now)
        self.ctx.stream(entry, output)
        first_token = output.new_token_ids[0]
        entry.hand_off = asyncio.create_task(self._hand_off(entry, first_token, held))

    def stop(self, entry: WorkerRequest, reason: str, *, tell_gateway: bool) -> None:
        """Abort the request; TRANSFERRING, its hand-off is cancelled and cleans up."""
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
        sender = ctx.link.sender(
            request_id, first_token, subject, entry.offered_transports, deadline, entry.decode_epoch
        )
        entry.transport = sender.name
        try:
            if held is None:  # the first token ended it; the engine has freed it: no KV to move
                await sender.abort("finished")
                ctx.table.end(entry, "finished", time.time())
                return
            await self._transfer(entry, sender, held)
        except asyncio.CancelledError:  # stopped: a Cancel, or a failure to report
            ctx.engine.abort(request_id)
            reason = entry.failure or "cancelled"
            if entry.failure:
                ctx.fail(entry, entry.failure)
            else:
                ctx.table.end(entry, reason, time.time())
            await sender.abort(reason)
        except Exception as exc:
            reason = str(exc) if isinstance(exc, TransferError) else f"internal error: {exc!r}"
            log.warning("%s: KV transfer failed: %s", request_id, reason)
            ctx.engine.abort(request_id)
            await sender.abort(reason)
            ctx.fail(entry, reason)
        else:
            ctx.engine.kv.release(request_id)
            ctx.table.end(entry, "finished", time.time())

    async def _transfer(self, entry: WorkerRequest, sender: KVSender, held: HeldBlocks) -> None:
        """Move the blocks decode lacks by the transport both ends take."""
        ctx, request_id, layout = self.ctx, entry.request_id, self.ctx.layout
        num_blocks = max(0, len(held.block_ids) - entry.skip_blocks)
        num_bytes = num_blocks * layout.block_bytes * layout.num_layers
        span = ctx.telemetry.start_send(entry, num_blocks, num_bytes)
        sender.headers = inject(span)
        started = time.perf_counter()
        try:
            await sender.send(entry.skip_blocks, held, ctx.engine.kv.params(request_id))
        except BaseException as exc:
            error = "cancelled" if isinstance(exc, asyncio.CancelledError) else str(exc)
            ctx.telemetry.end_send(entry, span, time.perf_counter() - started, 0, error)
            raise
        seconds = time.perf_counter() - started
        ctx.kv_blocks_sent += num_blocks
        self.peers.sent(entry.decode_worker, entry.transport, num_blocks, num_bytes, seconds)
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
