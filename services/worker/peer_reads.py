"""`PeerReads`: a worker reads the prefix blocks the scheduler says another worker holds
(`PeerPrefix` on its task) into its own pool before it queues the prompt, so the engine
finds them as prefix-cache hits and computes only the rest (docs/kv_tier.md).

In order: the cost check (shared/kvtransfer/peer_cost.py) → fresh blocks for the blocks this
pool lacks (shared/engine/kv_tier/peer.py) → `PrefixPin` to the holder, request/reply →
the answer checked (shared/kvtransfer/peer_pin.py) → one READ by the one-sided transport
the prefill → decode hand-off uses → the blocks adopted as cached, and a `RELEASE` to the
holder. Everything is bounded by `--kv-peer-read-timeout` and the request's deadline.

When the hint names other holders (`PeerPrefix.others`), a read that fails for a reason
of its holder (gone, pin refused, a bad answer, a READ lost) is counted and the next holder
is asked, into the same taken blocks and within the same deadline.

The one subtle rule: `read` never fails the request. Any failure — the holder gone, the pin
refused, a stale or forged answer, a READ lost or late — gives the taken blocks back and is
counted by reason (`PeerFallback`); the prompt is then computed as without a hint. Given
back means once no READ into them is in flight (`TakenBlocks`): a READ given up on still
lands (transfer.read_blocks), so neither the pool nor the next holder gets them before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from nats.errors import Error as NatsError

from services.worker.engine_client import PeerBlocks
from shared.bus import Bus
from shared.engine.kv_tier.peer import PeerTake
from shared.kvtransfer.link import KVLink
from shared.kvtransfer.peer_cost import PeerReadCost
from shared.kvtransfer.peer_pin import PinRefused, check_pinned
from shared.kvtransfer.transfer import KVTransport, TransferError, read_blocks
from shared.prefix_messages import (
    PeerFallback,
    PeerPrefix,
    PeerReadCounters,
    PinOp,
    PrefixPin,
    PrefixPinned,
)
from shared.protocol import SubmitRequest, WireError
from shared.subjects import Subjects

log = logging.getLogger(__name__)

# A read that failed for one of these may succeed from another holder of the blocks.
NEXT_HOLDER = frozenset(
    {
        PeerFallback.HOLDER_GONE,
        PeerFallback.PIN_REFUSED,
        PeerFallback.BAD_REPLY,
        PeerFallback.READ_FAILED,
    }
)


class PeerReads:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        link: KVLink,
        blocks: PeerBlocks | None,
        timeout: float,  # seconds a read may take at most, pin to READ's end
        prefill_rate: Callable[[], float],  # this worker's measured prompt tokens per second
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.link = link
        self.blocks = blocks
        self.timeout = timeout
        self.prefill_rate = prefill_rate
        self.cost = PeerReadCost()
        self.counters = PeerReadCounters(fallbacks=[0] * len(PeerFallback))

    async def read(self, request: SubmitRequest, hint: PeerPrefix | None) -> int:
        """Read the hinted blocks this pool lacks; how many it read (0: it computes them)."""
        if hint is None or hint.holder == self.link.agent:
            return 0
        try:
            return await self._read(request, hint)
        except PinRefused as refused:
            self._fell_back(request, hint, refused)
            return 0

    def _fell_back(self, request: SubmitRequest, hint: PeerPrefix, refused: PinRefused) -> None:
        self.counters.fallbacks[refused.reason] += 1
        log.info(
            "%s: prefix blocks of %s not read (%s): %s",
            request.request_id,
            hint.holder,
            refused.reason.name.lower(),
            refused,
        )

    def snapshot(self) -> PeerReadCounters:
        c = self.counters
        return PeerReadCounters(c.blocks, c.bytes, c.seconds, list(c.fallbacks), c.pinned_for_peers)

    async def _read(self, request: SubmitRequest, hint: PeerPrefix) -> int:
        transport, blocks = self.link.one_sided, self.blocks
        if transport is None or blocks is None:
            raise PinRefused(PeerFallback.NO_TRANSPORT, "no one-sided KV transport here")
        layout = self.link.layout
        num_bytes = hint.num_blocks * layout.block_bytes * layout.num_layers
        tokens = hint.num_blocks * layout.block_size
        if not self.cost.pays(num_bytes, tokens, self.prefill_rate()):
            detail = f"{self.cost.seconds(num_bytes):.4f} s to read, {tokens} tokens to compute"
            raise PinRefused(PeerFallback.NOT_WORTH, detail)
        loop = asyncio.get_running_loop()
        remaining = min(self.timeout, request.deadline - time.time())
        if remaining <= 0:
            raise PinRefused(PeerFallback.READ_LATE, "the request's deadline has passed")
        deadline = loop.time() + remaining
        take = await blocks.take_for_peer(request, hint.first_block + hint.num_blocks)
        if take is None:
            raise PinRefused(PeerFallback.NO_ROOM, "the prompt would not fit beside them")
        if not take.block_ids:
            return 0  # this pool holds them already (the scheduler's view was older)
        taken, num_read = TakenBlocks(blocks, take), 0
        try:
            num_read = await self._from_holders(request, hint, transport, taken, deadline)
        finally:
            taken.over(num_read)  # the blocks not read go back
        return num_read

    async def _from_holders(
        self,
        request: SubmitRequest,
        hint: PeerPrefix,
        transport: KVTransport,
        taken: TakenBlocks,
        deadline: float,
    ) -> int:
        """Read from the hint's holders in turn: the next one after a failure of its holder,
        while time is left and no READ given up on still lands in the blocks; PinRefused of
        the last one tried."""
        holders = [h for h in hint.holders() if h.holder != self.link.agent]
        loop = asyncio.get_running_loop()
        for index, holder in enumerate(holders):
            try:
                return await self._pin_and_read(request, holder, transport, taken, deadline)
            except PinRefused as refused:
                last = index == len(holders) - 1 or loop.time() >= deadline
                if last or refused.reason not in NEXT_HOLDER or taken.in_flight:
                    raise
                self._fell_back(request, holder, refused)
        return 0

    async def _pin_and_read(
        self,
        request: SubmitRequest,
        hint: PeerPrefix,
        transport: KVTransport,
        taken: TakenBlocks,
        deadline: float,
    ) -> int:
        loop, pin_id, holder = asyncio.get_running_loop(), request.request_id, hint.holder
        take = taken.take
        began = loop.time()
        pin = PrefixPin(
            pin_id,
            self.link.agent,
            PinOp.PIN,
            take.block_hashes,
            deadline - began,
            hint.holder_epoch,
        )
        subject = self.subjects.prefix(holder)
        try:
            reply = await self.bus.request(subject, pin, PrefixPinned, max(0.001, deadline - began))
        except WireError as exc:
            raise PinRefused(PeerFallback.BAD_REPLY, str(exc)) from None
        except (TimeoutError, NatsError) as exc:
            raise PinRefused(PeerFallback.HOLDER_GONE, repr(exc)) from None
        pinned = loop.time()
        try:
            layout = self.link.layout
            count = check_pinned(reply, pin_id, hint, take.block_hashes, layout, transport.name)
            try:
                transport.connect(holder, reply.agent_metadata, reply.num_cache_blocks)
            except ValueError as exc:
                raise PinRefused(PeerFallback.BAD_REPLY, str(exc)) from None
            read_by = min(deadline, loop.time() + reply.read_by - time.time())
            try:
                local = take.block_ids[:count]
                keep = taken.reading()
                await read_blocks(transport, holder, reply.block_ids, local, read_by, keep=keep)
            except ValueError as exc:  # ids the transport refuses before any byte moves
                raise PinRefused(PeerFallback.BAD_REPLY, str(exc)) from None
            except TransferError as exc:
                late = loop.time() > read_by
                reason = PeerFallback.READ_LATE if late else PeerFallback.READ_FAILED
                raise PinRefused(reason, str(exc)) from None
        finally:
            with contextlib.suppress(Exception):  # best effort: the holder's deadline ends it too
                release = PrefixPin(pin_id, self.link.agent, PinOp.RELEASE)
                await self.bus.publish(subject, release)
        done = loop.time()
        num_bytes = count * layout.block_bytes * layout.num_layers
        self.cost.observe(pinned - began, num_bytes, done - pinned)
        self.counters.blocks += count
        self.counters.bytes += num_bytes
        self.counters.seconds += done - began
        return count


class TakenBlocks:
    """The blocks taken for one read, given to the pool once (`PeerBlocks.adopt`: the read
    ones cached, the rest freed): when the read is `over` and no READ into them is in flight
    (`reading` is what `read_blocks` keeps until its READ has ended)."""

    def __init__(self, blocks: PeerBlocks, take: PeerTake) -> None:
        self.blocks = blocks
        self.take = take
        self.in_flight = 0  # READs into the blocks not ended yet
        self._num_read: int | None = None  # the read's outcome, once it is over
        self._settled = False

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._settle()

    def over(self, num_read: int) -> None:
        """The read is over: its first `num_read` blocks were read."""
        self._num_read = num_read
        self._settle()

    def _settle(self) -> None:
        if self._num_read is None or self.in_flight or self._settled:
            return
        self._settled = True
        self.blocks.adopt(self.take, self._num_read)
