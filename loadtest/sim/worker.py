"""A modelled worker: the engine's continuous batching, with step times from the cost model.

Queues, in order (as shared/engine/scheduler.py): waiting → running → ended, plus, outside
them, reserved (decode side: blocks held until the KV is in) and held (prefill side: the
prompt is computed and its first token sent; blocks held until the KV has moved).
Each step spends a token budget (`max_num_batched_tokens`): running sequences first, oldest
first (one token for a decode row, a chunk for an unfinished prompt), then waiting ones join
while the budget, `max_num_seqs` and free blocks allow. Its heartbeat reports what a real
worker's does, measured the same way (services/worker/step_costs.py).

Roles change as services/worker/role_change.py does: with `next_role` set nothing new is
placed on the worker, the sides the new role drops finish what they hold, then the role
switches. A draining worker finishes what it holds and leaves.

The one subtle rule: the worker steps only while it has work; an idle one costs no event.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from loadtest.sim.cost_model import CostModel
from loadtest.sim.events import EventLoop
from loadtest.sim.kv import KVPool
from loadtest.sim.requests import SeqKind, SimRequest, SimSeq, blocks_of
from services.scheduler.routing import DECODE_ROLES
from services.worker.step_costs import BusyShare, Ewma, StepTimer
from shared.protocol import FirstToken, Heartbeat, KVEvents, KVPeer

MODEL = "sim"  # every modelled worker serves it; block hashes use it as the model id
PREFILL_SIDE = (SeqKind.PREFILL,)
DECODE_SIDE = (SeqKind.LOCAL, SeqKind.DECODE)


class Sink(Protocol):
    """What the mesh hears from a worker."""

    def prefilled(self, seq: SimSeq, worker: SimWorker) -> None: ...  # move its KV now
    def finished(self, request: SimRequest) -> None: ...
    def kv_events(self, events: KVEvents) -> None: ...
    def idle(self, worker: SimWorker) -> None: ...  # a draining worker holds nothing now


@dataclass(frozen=True, slots=True)
class EngineLimits:
    block_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64


class Peer:
    """KV sent to one decode worker, measured as the worker's KV sender measures it."""

    def __init__(self) -> None:
        self.blocks = self.transfers = 0
        self.mean_bytes, self.mean_seconds, self.latency = Ewma(), Ewma(), Ewma()

    def wire(self, worker_id: str) -> KVPeer:
        return KVPeer(
            worker_id,
            "nixl",
            self.blocks,
            self.transfers,
            self.mean_bytes.value,
            self.mean_seconds.value,
            self.latency.value,
        )


class SimWorker:
    def __init__(
        self,
        worker_id: str,
        role: str,
        cores: int,
        loop: EventLoop,
        cost: CostModel,
        limits: EngineLimits,
        sink: Sink,
    ) -> None:
        self.worker_id, self.role, self.cores = worker_id, role, cores
        self.loop, self.cost, self.limits, self.sink = loop, cost, limits, sink
        self.next_role = ""
        self.draining = False
        self.pool = KVPool(cost.kv_blocks)
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.reserved: dict[str, SimSeq] = {}
        self.held: dict[str, SimSeq] = {}
        self.stepping = False
        self.timer, self.busy = StepTimer(), BusyShare()
        self.busy_share = 0.0  # of the last heartbeat interval
        self.first_tokens: list[FirstToken] = []
        self.peers: dict[str, Peer] = {}
        self.kv_seq = -1

    # -- what the scheduler may place here --------------------------------------------------
    @property
    def placeable(self) -> bool:
        return not (self.draining or self.next_role)

    def takes_prefill(self) -> bool:
        return self.placeable and self.role == "prefill"

    def takes_decode(self) -> bool:
        return self.placeable and self.role in DECODE_ROLES

    def add(
        self, request: SimRequest, kind: SeqKind, decode_to: str = "", missing: int = 0
    ) -> None:
        """A local request (DecodeTask) or a prompt to prefill for `decode_to` (PrefillTask)."""
        blocks = blocks_of(request, self.limits.block_size, kind is SeqKind.LOCAL)
        self.waiting.append(SimSeq(request, kind, blocks, 0, decode_to, missing))
        self.kick()

    def reserve(self, request: SimRequest) -> int | None:
        """Blocks for the prompt and its reply; the leading blocks cached here (None: no room)."""
        blocks = blocks_of(request, self.limits.block_size, with_reply=True)
        if not self.pool.can_hold(blocks):
            return None
        overlap = self.pool.overlap(request.hashes)
        self.pool.hold(blocks)
        seq = SimSeq(request, SeqKind.DECODE, blocks, request.prompt_len)
        self.reserved[request.request_id] = seq
        return overlap

    def kv_arrived(self, request_id: str) -> None:
        seq = self.reserved.pop(request_id)
        self.pool.store(seq.request.hashes)
        self.running.append(seq)
        self._flush_kv_events()
        self.kick()

    def sent(self, seq: SimSeq, seconds: float) -> None:
        """Prefill side: `seq`'s KV has moved in `seconds`."""
        del self.held[seq.request.request_id]
        self.pool.release(seq.blocks)
        peer = self.peers.setdefault(seq.decode_to, Peer())
        peer.blocks += seq.missing_blocks
        peer.transfers += 1
        peer.mean_bytes.add(seq.missing_blocks * self.cost.block_bytes)
        peer.mean_seconds.add(seconds)
        if seq.missing_blocks <= 1:  # a small transfer: its time is the fixed cost
            peer.latency.add(seconds)
        self.kick()  # the blocks freed may admit a waiting prompt

    # -- steps ------------------------------------------------------------------------------
    def kick(self) -> None:
        if self.stepping:
            return
        chunks, rows = self._schedule()
        if not (chunks or rows):
            self._settle()
            return
        seconds = self.cost.step_s(
            self.cores, [(n, seq.computed) for seq, n in chunks], [s.context for s in rows]
        )
        self.stepping = True
        self.loop.after(seconds, lambda: self._end_step(chunks, rows, seconds))

    def _schedule(self) -> tuple[list[tuple[SimSeq, int]], list[SimSeq]]:
        budget = self.limits.max_num_batched_tokens
        chunks: list[tuple[SimSeq, int]] = []
        rows: list[SimSeq] = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                n = min(seq.request.prompt_len - seq.computed, budget)
                chunks.append((seq, n))
                budget -= n
            else:
                rows.append(seq)
                budget -= 1
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            if not self.pool.can_hold(seq.blocks):
                break
            self.waiting.popleft()
            cached = self.pool.overlap(seq.request.hashes) * self.limits.block_size
            self.pool.hold(seq.blocks)
            seq.computed = min(cached, seq.request.prompt_len - 1)
            self.running.append(seq)
            n = min(seq.request.prompt_len - seq.computed, budget)
            chunks.append((seq, n))
            budget -= n
        return chunks, rows

    def _end_step(
        self, chunks: list[tuple[SimSeq, int]], rows: list[SimSeq], seconds: float
    ) -> None:
        self.stepping = False
        now = self.loop.now
        self.timer.observe(seconds, sum(n for _, n in chunks), len(rows))
        for seq in rows:
            request = seq.request
            request.output_tokens += 1
            request.last_token = now
            if request.done:
                self._end(seq)
        for seq, n in chunks:
            seq.computed += n
            if seq.prefilling:
                continue
            request = seq.request
            self.pool.store(request.hashes)
            request.first_token = request.last_token = now
            request.output_tokens = 1
            self.first_tokens.append(FirstToken(request.request_id, now - request.send))
            if seq.kind is SeqKind.PREFILL:
                self.running.remove(seq)
                self.held[request.request_id] = seq
                self.sink.prefilled(seq, self)
            elif request.done:
                self._end(seq)
        self._flush_kv_events()
        self.kick()

    def _end(self, seq: SimSeq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.pool.release(seq.blocks)
        if seq.kind is not SeqKind.PREFILL:
            self.sink.finished(seq.request)

    def cancel_reservation(self, request_id: str) -> None:
        seq = self.reserved.pop(request_id, None)
        if seq is not None:
            self.pool.release(seq.blocks)
            self.kick()

    def _flush_kv_events(self) -> None:
        stored, removed = self.pool.drain_events()
        if stored or removed:
            self.kv_seq += 1
            self.sink.kv_events(KVEvents(self.worker_id, self.kv_seq, stored, removed))

    # -- roles, draining --------------------------------------------------------------------
    def holds(self, kinds: tuple[SeqKind, ...]) -> bool:
        seqs = [*self.waiting, *self.running, *self.held.values(), *self.reserved.values()]
        return any(seq.kind in kinds for seq in seqs)

    def _settle(self) -> None:
        """Between steps: end a role change whose dropped sides hold nothing; report a
        draining worker that holds nothing at all."""
        if self.next_role:
            dropped = []
            if self.role in ("prefill", "both") and self.next_role == "decode":
                dropped = list(PREFILL_SIDE)
            if self.role in DECODE_ROLES and self.next_role == "prefill":
                dropped = list(DECODE_SIDE)
            if not self.holds(tuple(dropped)):
                self.role, self.next_role = self.next_role, ""
        if self.draining and not self.holds(PREFILL_SIDE + DECODE_SIDE):
            self.sink.idle(self)

    # -- heartbeat --------------------------------------------------------------------------
    def heartbeat(self) -> Heartbeat:
        costs = self.timer.current
        queued = sum(s.request.prompt_len - s.computed for s in [*self.waiting, *self.running])
        first, self.first_tokens = self.first_tokens, []
        self.busy_share = self.busy.share(costs.busy_seconds, self.loop.now)
        return Heartbeat(
            self.worker_id,
            self.role,
            MODEL,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            free_blocks=self.pool.free,
            total_blocks=self.pool.total,
            block_size=self.limits.block_size,
            draining=self.draining,
            num_requests=len(self.waiting) + len(self.running) + len(self.held),
            kv_peers=[peer.wire(w) for w, peer in sorted(self.peers.items())],
            prefill_rate=costs.prefill_rate,
            decode_step_s=costs.decode_step_s,
            stall_s=costs.stall_s,
            stream_tokens=min((s.request.output_len for s in self.running), default=0),
            decode_batch=costs.decode_batch,
            decode_row_s=costs.decode_row_s,
            queued_prompt_tokens=queued,
            busy=self.busy_share,
            block_bytes=self.cost.block_bytes,
            first_tokens=first,
            next_role=self.next_role,
        )
