"""`KVTier`: the engine's second KV tier, where prefix blocks evicted from the pool go, and
whence a prefix lookup that misses the pool loads them back instead of recomputing them.

The block manager calls `save` with the cached blocks one of its calls evicted (those worth
writing, admission.py, are copied out at once, in one gather, before they are reused, and
the writer thread checksums and stores them), `asked` with the blocks an admission missed
in the pool (how the tier learns that evicted blocks return), `loading` for the requests
admitted next (the loader thread, prefetch.py, reads their entries while the step runs),
`held_run` and `pays` to plan an admission, and `load` to fill fresh blocks. The one subtle
rule: `load` fills a prefix of the blocks asked for and says how many; an entry missing,
refused (entry.py), unreadable or read too late ends the run there, and the blocks past it
are computed as if never stored.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shared.engine.kv_cache import KVCache
from shared.engine.kv_tier.admission import WriteAdmission
from shared.engine.kv_tier.entry import BadEntry, TierLayout, decode_entry
from shared.engine.kv_tier.policy import LoadPolicy
from shared.engine.kv_tier.prefetch import FetchState, Result, TierPrefetch
from shared.engine.kv_tier.sizing import tier_capacity
from shared.engine.kv_tier.store import TierStore
from shared.engine.kv_tier.tier_stats import TierStats
from shared.engine.kv_tier.writer import TierWriter

if TYPE_CHECKING:
    from shared.engine.engine_config import EngineConfig

log = logging.getLogger(__name__)


def default_root() -> Path:
    """/dev/shm where it exists (memory, no disk), else the temporary directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "splitserve-kv"


def open_tier(config: EngineConfig, kv_cache: KVCache) -> KVTier | None:
    """The tier `config` asks for, or None: size 0 (or an automatic size with no room:
    sizing.py), no prefix caching, or a draft model (whose own KV of a block the tier does
    not keep)."""
    if config.kv_offloading_size == 0 or not config.enable_prefix_caching:
        return None
    if config.speculative == "draft":
        log.warning("KV tier: off, since a draft model's KV is not kept in it")
        return None
    root = Path(config.kv_offloading_dir) if config.kv_offloading_dir else default_root()
    capacity = tier_capacity(config.kv_offloading_size, root)
    return KVTier.open(kv_cache, config.model_id, root, capacity) if capacity else None


def tier_layout(kv_cache: KVCache, model_id: str) -> TierLayout:
    dtype = kv_cache.dtype
    return TierLayout(
        model_id=model_id,
        dtype=str(dtype).removeprefix("torch."),
        block_size=kv_cache.block_shape[0],
        shape=(kv_cache.num_layers, *kv_cache.block_shape),
        element_size=torch.empty((), dtype=dtype).element_size(),
    )


class KVTier:
    def __init__(self, kv_cache: KVCache, store: TierStore, layout: TierLayout) -> None:
        self.kv_cache = kv_cache
        self.store = store
        self.layout = layout
        self.writer = TierWriter(store, layout)
        pool_blocks = kv_cache.layers[0].shape[0]  # a return keeps writes on for a pool's worth
        self.admission = WriteAdmission(store.capacity_bytes // layout.entry_bytes, pool_blocks)
        self.policy = LoadPolicy(layout.block_size)
        self.prefetch = TierPrefetch(self._fetch)
        self._layers = range(kv_cache.num_layers)
        self.hits = self.refused = self.skipped = self.bytes_in = self.prefetched = self.late = 0
        self.load_seconds = 0.0

    @classmethod
    def open(cls, kv_cache: KVCache, model_id: str, root: Path, capacity_bytes: int) -> KVTier:
        layout = tier_layout(kv_cache, model_id)
        store = TierStore(root, capacity_bytes, layout)
        log.info("KV tier: %d MiB in %s (%s)", capacity_bytes >> 20, store.path, layout.name)
        return cls(kv_cache, store, layout)

    def save(self, evicted: list[tuple[int, int]]) -> None:
        """The blocks of `evicted` (block id, the hash it was cached as) are being evicted:
        keep a copy of those not stored yet that are worth writing (admission.py), as many
        as the writer's queue takes."""
        if self.writer.stopped:
            return
        new = [(block_id, h) for block_id, h in evicted if not self.store.holds(h)]
        admitted = self.admission.admit([h for _, h in new])
        wanted = [pair for pair, admit in zip(new, admitted, strict=True) if admit]
        room = self.writer.room()
        if len(wanted) > room:
            self.writer.drop(len(wanted) - room)
            wanted = wanted[:room]
        if wanted:
            block_ids = [block_id for block_id, _ in wanted]
            blocks = self.kv_cache.read_blocks(block_ids, self._layers)  # [L, n, bs, 2, h, d]
            self.writer.offer([h for _, h in wanted], blocks)

    def asked(self, hashes: list[int]) -> None:
        """An admission missed the pool at `hashes` (those past its pool hits, in order)."""
        self.admission.asked(hashes, self.store.holds)

    def held_run(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, the tier holds."""
        count = 0
        for block_hash in hashes:
            if not self.store.holds(block_hash):
                break
            count += 1
        return count

    def pays(self) -> bool:
        return self.policy.pays()

    def loading(self, hashes: list[int]) -> bool:
        """Are the blocks of `hashes` (those past the pool's hits) the tier holds on their
        way, read beside the step and within their deadline? Starts the reads if not yet."""
        run = hashes[: self.held_run(hashes)]
        if not run or not self.pays():
            return False
        self.prefetch.start(run, time.monotonic() + self.policy.wait_s(len(run)))
        return self.prefetch.waiting(run)

    def skip(self, num_blocks: int) -> None:
        """Count blocks the tier held but that will be recomputed (loading costs more)."""
        self.skipped += num_blocks

    def load(self, block_ids: list[int], hashes: list[int]) -> int:
        """Fill `block_ids` with the stored blocks `hashes`; how many, from the first, it did."""
        began = time.perf_counter()
        blocks = []
        for block_hash in hashes:
            payload = self._payload(block_hash)
            if payload is None:
                break
            self.bytes_in += len(payload)
            flat = torch.frombuffer(payload, dtype=torch.uint8)  # no copy: a writable buffer
            blocks.append(flat.view(self.kv_cache.dtype).view(self.layout.shape))
        if blocks:  # [L, n, bs, 2, h, d], as write_blocks takes them
            data = torch.stack(blocks, dim=1)
            self.kv_cache.write_blocks(block_ids[: len(blocks)], self._layers, data)
            self.hits += len(blocks)
            seconds = time.perf_counter() - began
            self.load_seconds += seconds
            self.policy.observe_load(seconds, len(blocks))
        return len(blocks)

    def stats(self) -> TierStats:
        store, writer = self.store, self.writer
        return TierStats(
            hits=self.hits,
            refused=self.refused,
            skipped=self.skipped,
            bytes_in=self.bytes_in,
            bytes_out=writer.bytes_written,
            load_seconds=self.load_seconds,
            evictions=store.evictions,
            prefetched=self.prefetched,
            late=self.late,
            dropped_writes=writer.dropped,
            unwritten=self.admission.unwritten,
            stored_bytes=store.stored_bytes,
            capacity_bytes=store.capacity_bytes,
            write_stopped=writer.stopped,
        )

    def close(self) -> None:
        self.prefetch.close()
        self.writer.close()
        self.store.close()

    def _payload(self, block_hash: int) -> memoryview | None:
        """The entry's payload, read beside a step or now; None: not stored, refused (then
        forgotten), or its read beside the steps passed its deadline (recomputed)."""
        state, result = self.prefetch.take(block_hash)
        if state == FetchState.LATE:
            self.late += 1
            return None
        if state == FetchState.DONE:
            self.prefetched += isinstance(result, memoryview)
        else:  # never asked, or still on its way while nothing else runs: read it now
            result = self._fetch(block_hash)
        if isinstance(result, Exception):
            self.refused += 1
            log.warning("KV tier: block %x refused, recomputed: %s", block_hash, result)
            self.store.discard(block_hash)
            return None
        return result

    def _fetch(self, block_hash: int) -> Result | None:
        """The entry's checked payload, None when not stored, or why it is refused (on the
        engine's thread or the loader's: the store is thread-safe)."""
        try:
            data = self.store.get(block_hash)
            if data is None:
                return None
            return decode_entry(self.layout, block_hash, data)
        except (OSError, BadEntry) as exc:
            return exc
