"""Paged KV block allocator with reference counts and a chained-hash prefix cache.

A block is in exactly one of three states:
- referenced: ref_count > 0, in some sequence's block table;
- free and cached: ref_count == 0 but its hash is registered, so a later prompt with the
  same prefix can claim it; kept in LRU order and evicted oldest first when space is needed;
- free and empty: ref_count == 0, no hash; handed out before any cached block is evicted.
Only full blocks whose KV has been computed are registered in the cache. Every hash
registered or evicted is recorded as it happens (`events`, see stats.KVEventLog).
With a second tier (kv_tier/), the cached blocks one call evicts are offered to it together
before the call returns (those it keeps are copied in one gather, before any of them is
written again); an admission tells it which blocks it missed in the pool, and one
that misses the pool loads the run of blocks that follows its pool hits from the tier into
fresh blocks, when loading pays; they are then cached like computed ones. A sequence's
block hashes are computed once (`hashes`): asking every step costs no hashing.
Blocks read from another worker (kv_tier/peer.py) are taken fresh (`take_blocks`), filled by
the READ, then `adopt`ed as cached; a holder keeps the blocks a peer READs by an extra
reference (`pin_cached`, then `unpin`), so they are never evicted while bytes leave them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from shared.engine.block_hash import cache_key, extend_hashes
from shared.engine.errors import OutOfBlocks
from shared.engine.sequence import Sequence
from shared.engine.stats import KVEventLog

if TYPE_CHECKING:
    from shared.engine.kv_tier.tier import KVTier


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_id: str = "",
        enable_prefix_caching=True,
        tier: KVTier | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_id = model_id
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens served from it
        self.evictions = 0
        self.events = KVEventLog()  # hashes registered and evicted since the last take
        self.tier = tier  # where evicted cached blocks go, and come back from
        self._evicted: list[tuple[int, int]] = []  # (block id, hash) evicted, not yet saved

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(
            0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        )

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def room(self, seq: Sequence) -> int:
        """How many more tokens `seq` could get slots for now."""
        slots = (len(seq.block_table) + self.num_free_blocks) * self.block_size
        return slots - seq.num_computed_tokens

    def can_allocate(self, seq: Sequence, token_budget: int) -> bool:
        """Would `allocate` then `allocate_slots` for up to `token_budget` new tokens fit?
        Changes nothing, so a refused admission leaves the cache and its counters alone."""
        hits, hashes = self._lookup(seq) if self._reuses(seq) else ([], [])
        reclaimed = sum(1 for block_id, _ in hits if self.ref_counts[block_id] == 0)
        loads = self._tier_run(hashes[len(hits) :], self.num_free_blocks - reclaimed)
        cached_tokens = (len(hits) + loads) * self.block_size
        num_tokens = min(seq.num_tokens - cached_tokens, token_budget)
        needed = self.blocks_for(cached_tokens + num_tokens) - len(hits)
        return needed <= self.num_free_blocks - reclaimed

    def loading(self, seq: Sequence) -> bool:
        """Are blocks of `seq` (not admitted yet) on their way from the tier, read beside the
        step and within their deadline? The first time it is asked, the reads start."""
        if self.tier is None or seq.block_table or not self._reuses(seq):
            return False
        hits, hashes = self._lookup(seq)
        return self.tier.loading(hashes[len(hits) :])

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        """Admit `seq`: claim the longest cached prefix of its tokens (never all of them, so at
        least one token is computed and yields logits), from the pool then the tier. Sets
        the computed and cached counts. A tier load may fill fewer blocks than `can_allocate`
        planned for: `room` then bounds the tokens to compute."""
        assert not seq.block_table, "allocate() is for a sequence that holds no blocks"
        hits, hashes = self._lookup(seq) if self._reuses(seq) else ([], [])
        for block_id, _ in hits:
            self._claim(block_id)
        seq.block_table = [block_id for block_id, _ in hits]
        seq.block_hashes = [block_hash for _, block_hash in hits]
        self._load_from_tier(seq, hashes[len(hits) :])
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table so the next `num_new_tokens` tokens have slots."""
        needed = self.num_new_blocks(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(
                f"{seq.request_id}: needs {needed} blocks, {self.num_free_blocks} free"
            )
        for _ in range(needed):
            block_id = self._pop_free()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        self._save_evicted()

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that computing has filled since the last commit."""
        if not self.enable_prefix_caching:
            return
        known = len(seq.block_hashes)
        full = self.hashes(seq)[known : seq.num_computed_tokens // self.block_size]
        seq.block_hashes.extend(full)
        for index in range(known, len(seq.block_hashes)):
            block_id, block_hash = seq.block_table[index], seq.block_hashes[index]
            if block_hash not in self.cached:  # a duplicate of a cached block stays anonymous
                self.cached[block_hash] = block_id
                self.block_hashes[block_id] = block_hash
                self.events.stored(block_hash)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its tail blocks become the first candidates for eviction."""
        for block_id in reversed(seq.block_table):
            self._drop(block_id, seq.request_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = seq.num_draft_computed_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens' (speculative decoding: the
        slots of rejected draft tokens). Those blocks were never full, so never hashed."""
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            assert self.ref_counts[block_id] == 1 and self.block_hashes[block_id] is None
            self.ref_counts[block_id] = 0
            self._empty.append(block_id)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Share `parent`'s blocks with `child`. A partly filled last block is copied (it will
        diverge); returns the (source, destination) block pairs whose KV the caller copies."""
        assert not child.block_table, "fork() needs a child that holds no blocks"
        num_full = parent.num_computed_tokens // self.block_size
        if len(parent.block_table) - num_full > self.num_free_blocks:
            raise OutOfBlocks(f"{child.request_id}: too few free blocks to fork into")
        copies = []
        for index, block_id in enumerate(parent.block_table):
            if index < num_full:
                self.ref_counts[block_id] += 1
                child.block_table.append(block_id)
            else:
                new_block = self._pop_free()
                self.ref_counts[new_block] = 1
                child.block_table.append(new_block)
                copies.append((block_id, new_block))
        self._save_evicted()
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        return copies

    def forget_cached(self) -> None:
        """Evict every cached block no sequence holds (each reported removed)."""
        while self._evictable:
            self._empty.append(self._evict_oldest())
        self._save_evicted()

    # -- blocks read by or from another worker (kv_tier/peer.py) -----------------------------
    def pin_cached(self, hashes: list[int]) -> list[int]:
        """The block ids of the leading run of `hashes` the pool caches, each claimed (an
        extra reference: not evicted, not reused) until `unpin`."""
        block_ids = []
        for block_hash in hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            self._claim(block_id)
            block_ids.append(block_id)
        return block_ids

    def take_blocks(self, count: int) -> list[int]:
        """`count` fresh blocks, each referenced once by nobody's table, for a READ to fill."""
        if count > self.num_free_blocks:
            raise OutOfBlocks(f"{count} blocks to read into, {self.num_free_blocks} free")
        block_ids = [self._pop_free() for _ in range(count)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        self._save_evicted()  # before the READ writes them
        return block_ids

    def adopt(self, block_ids: list[int], hashes: list[int]) -> None:
        """Blocks of `take_blocks` that a READ filled become cached as `hashes` and free
        (the newest to evict); one whose hash the pool caches already is given back."""
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            if block_hash not in self.cached:
                self.cached[block_hash] = block_id
                self.block_hashes[block_id] = block_hash
                self.events.stored(block_hash)
        self.unpin(block_ids)

    def unpin(self, block_ids: list[int]) -> None:
        """Drop the reference `pin_cached` or `take_blocks` took of each block."""
        for block_id in block_ids:
            self._drop(block_id, "a pin")

    def _drop(self, block_id: int, holder: str) -> None:
        """One reference fewer; at none the block is free (cached: evictable, else empty)."""
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"block {block_id} freed twice ({holder})")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hashes[block_id] is None:
                self._empty.append(block_id)
            else:
                self._evictable[block_id] = None

    # -- internals --------------------------------------------------------------------------
    def _reuses(self, seq: Sequence) -> bool:
        # Prompt logprobs need every prompt row computed (prompt_logprobs.py): no hits.
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None

    def hashes(self, seq: Sequence) -> list[int]:
        """The chained hash of every full block of `seq`'s tokens (keyed by its adapter too:
        block_hash.cache_key), kept on the sequence: only blocks filled since the last call
        are hashed. The caller must not change the list."""
        known = seq.token_block_hashes
        if len(known) < len(seq.token_ids) // self.block_size:
            key = cache_key(self.model_id, seq.params.adapter)
            extend_hashes(known, seq.token_ids, self.block_size, key)
        return known

    def _lookup(self, seq: Sequence) -> tuple[list[tuple[int, int]], list[int]]:
        """(block id, hash) of the cached full blocks that prefix `seq.token_ids[:-1]`, and
        the hashes of all those full blocks."""
        hashes = self.hashes(seq)[: (seq.num_tokens - 1) // self.block_size]
        hits = []
        for block_hash in hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append((block_id, block_hash))
        return hits, hashes

    def _tier_run(self, hashes: list[int], num_free: int) -> int:
        """How many of `hashes` (those past the pool hits) to load from the tier: the run it
        holds that no pool block holds, leaving a free block for the token computed after
        them; 0 when loading costs more than recomputing."""
        if self.tier is None or not self.tier.pays():
            return 0
        in_pool = next((i for i, h in enumerate(hashes) if h in self.cached), len(hashes))
        return max(0, min(self.tier.held_run(hashes[:in_pool]), num_free - 1))

    def _load_from_tier(self, seq: Sequence, hashes: list[int]) -> None:
        """Append to `seq` the blocks of `hashes` that the tier fills, cached as computed."""
        if self.tier is None or not hashes:
            return
        self.tier.asked(hashes)  # how the tier learns that evicted blocks return
        run = self._tier_run(hashes, self.num_free_blocks)
        if run == 0:
            if not self.tier.pays():
                self.tier.skip(self.tier.held_run(hashes))
            return
        block_ids = [self._pop_free() for _ in range(run)]
        self._save_evicted()  # before the load writes them
        loaded = self.tier.load(block_ids, hashes[:run])
        self._empty.extend(reversed(block_ids[loaded:]))
        for block_id, block_hash in zip(block_ids[:loaded], hashes, strict=False):
            self.ref_counts[block_id] = 1
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash
            self.events.stored(block_hash)
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)

    def _save_evicted(self) -> None:
        """Hand the tier the blocks evicted since the last call, all together (one copy),
        before any of them is written again: every caller of `_evict_oldest` ends here."""
        if self._evicted:
            assert self.tier is not None, "blocks are kept for a tier only"
            self.tier.save(self._evicted)
            self._evicted = []

    def _claim(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self.ref_counts[block_id] += 1

    def _pop_free(self) -> int:
        if self._empty:
            return self._empty.pop()
        return self._evict_oldest()

    def _evict_oldest(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self.block_hashes[block_id]
        assert block_hash is not None, "an evictable block has a hash"
        if self.tier is not None:
            self._evicted.append((block_id, block_hash))  # saved before it is written again
        del self.cached[block_hash]
        self.block_hashes[block_id] = None
        self.events.removed(block_hash)
        self.evictions += 1
        return block_id
