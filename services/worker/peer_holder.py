"""`PeerHolder`: this worker's side of another worker's prefix read (docs/kv_tier.md). It
answers `PrefixPin`s on `<ns>.worker.<id>.prefix`: the leading run of the asked blocks its
pool caches is pinned (not evicted, not reused) and its one-sided agent kept serving until
the reader's `RELEASE`, or the pin's hold time, whichever comes first.

The one subtle rule: a pin outlives nothing. Its hold is bounded (`MAX_HOLD_S` and the
reader's own), and a pin for another process of this worker (an epoch not its own) is
refused, so a reader never READs blocks a restarted process holds for something else.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.worker.engine_client import PeerBlocks
from shared.bus import Bus, Headers
from shared.epoch import stale
from shared.kvtransfer.link import KVLink
from shared.kvtransfer.transfer import KVTransport
from shared.prefix_messages import PeerReadCounters, PinOp, PrefixPin, PrefixPinned
from shared.protocol import Outcome
from shared.subjects import Subjects

log = logging.getLogger(__name__)
MAX_HOLD_S = 30.0  # no pin is held longer, whatever the reader asks


class PeerHolder:
    def __init__(self, link: KVLink, blocks: PeerBlocks | None, counters: PeerReadCounters) -> None:
        self.link = link
        self.blocks = blocks
        self.counters = counters  # its `pinned_for_peers`
        self._releases: dict[tuple[str, str], asyncio.Event] = {}  # (reader, pin id) → release
        self._holds: set[asyncio.Task[None]] = set()

    async def start(self, bus: Bus, subjects: Subjects) -> None:
        subject = subjects.prefix(self.link.agent)
        await bus.serve(subject, PrefixPin, self.on_pin, _bad_pin, concurrent=True)

    async def on_pin(self, pin: PrefixPin, headers: Headers) -> PrefixPinned:
        key = (pin.reader, pin.pin_id)
        if pin.op == PinOp.RELEASE:
            release = self._releases.get(key)
            if release is not None:
                release.set()
            return PrefixPinned(pin.pin_id, Outcome.OK, holder=self.link.agent)
        transport, blocks = self.link.one_sided, self.blocks
        if stale(pin.to_epoch, self.link.epoch):
            reason = f"for process epoch {pin.to_epoch}; this one is {self.link.epoch}"
            return self._refuse(pin, reason)
        if transport is None or blocks is None:
            return self._refuse(pin, "no one-sided KV transport here")
        if key in self._releases:
            return self._refuse(pin, "pinned for that read already")
        hold = min(pin.hold_s, MAX_HOLD_S)
        release = self._releases[key] = asyncio.Event()  # taken before the engine's answer
        block_ids: list[int] = []
        try:
            block_ids = await blocks.pin_cached(pin.block_hashes)
        finally:
            if not block_ids:
                del self._releases[key]
        if not block_ids:
            return self._refuse(pin, "none of the blocks is in the pool")
        self.counters.pinned_for_peers += len(block_ids)
        task = asyncio.create_task(self._hold(key, release, hold, transport, blocks, block_ids))
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)
        layout = transport.layout
        return PrefixPinned(
            pin.pin_id,
            Outcome.OK,
            holder=self.link.agent,
            epoch=self.link.epoch,
            transport=transport.name,
            agent_metadata=transport.metadata(),
            num_cache_blocks=transport.num_blocks,
            layout=[layout.num_layers, *layout.block_shape],
            dtype=layout.dtype,
            block_ids=block_ids,
            block_hashes=pin.block_hashes[: len(block_ids)],
            read_by=time.time() + hold,
        )

    async def _hold(
        self,
        key: tuple[str, str],
        release: asyncio.Event,
        hold: float,
        transport: KVTransport,
        blocks: PeerBlocks,
        block_ids: list[int],
    ) -> None:
        """Keep the blocks (and the agent serving) until the reader is done, or `hold` is up."""
        try:
            with transport.serving():
                await asyncio.wait_for(release.wait(), hold)
        except TimeoutError:
            log.info("prefix pin %s of %s: no release within %.1f s", key[1], key[0], hold)
        finally:
            del self._releases[key]
            blocks.unpin(block_ids)

    def _refuse(self, pin: PrefixPin, reason: str) -> PrefixPinned:
        return PrefixPinned(pin.pin_id, Outcome.UNAVAILABLE, reason, holder=self.link.agent)


def _bad_pin(reason: str) -> PrefixPinned:
    return PrefixPinned("?", Outcome.INVALID, reason)
