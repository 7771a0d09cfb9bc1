"""Paged KV block allocator with reference counts and a chained-hash prefix cache.

A block is in exactly one of three states:
- referenced: ref_count > 0, in some sequence's block table;
- free and cached: ref_count == 0 but its hash is registered, so a later prompt with the
  same prefix can claim it; kept in LRU order and evicted oldest first when space is needed;
- free and empty: ref_count == 0, no hash; handed out before any cached block is evicted.
Only full blocks whose KV has been computed are registered in the cache. Every hash
registered or evicted is recorded as it happens (`events`, see stats.KVEventLog).
"""

from __future__ import annotations

from collections import OrderedDict

from shared.engine.block_hash import hash_full_blocks
from shared.engine.errors import OutOfBlocks
from shared.engine.sequence import Sequence
from shared.engine.stats import KVEventLog


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, model_id: str = "", enable_prefix_caching=True
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

    def can_allocate(self, seq: Sequence, token_budget: int) -> bool:
        """Would `allocate` then `allocate_slots` for up to `token_budget` new tokens fit?
        Changes nothing, so a refused admission leaves the cache and its counters alone."""
        # Prompt logprobs need every prompt row computed (prompt_logprobs.py): no hits.
        reuse = self.enable_prefix_caching and seq.params.prompt_logprobs is None
        hits = self._lookup(seq.token_ids) if reuse else []
        num_tokens = min(seq.num_tokens - len(hits) * self.block_size, token_budget)
        needed = self.blocks_for(len(hits) * self.block_size + num_tokens) - len(hits)
        reclaimed = sum(1 for block_id, _ in hits if self.ref_counts[block_id] == 0)
        return needed <= self.num_free_blocks - reclaimed

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        """Admit `seq`: claim the longest cached prefix of its tokens (never all of them, so at
        least one token is computed and yields logits). Sets the computed and cached counts."""
        assert not seq.block_table, "allocate() is for a sequence that holds no blocks"
        # Prompt logprobs need every prompt row computed (prompt_logprobs.py): no hits.
        reuse = self.enable_prefix_caching and seq.params.prompt_logprobs is None
        hits = self._lookup(seq.token_ids) if reuse else []
        for block_id, _ in hits:
            self._claim(block_id)
        seq.block_table = [block_id for block_id, _ in hits]
        seq.block_hashes = [block_hash for _, block_hash in hits]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
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

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that computing has filled since the last commit."""
        if not self.enable_prefix_caching:
            return
        known = len(seq.block_hashes)
        seq.block_hashes = hash_full_blocks(
            seq.token_ids[: seq.num_computed_tokens],
            self.block_size,
            self.model_id,
            seq.block_hashes,
        )
        for index in range(known, len(seq.block_hashes)):
            block_id, block_hash = seq.block_table[index], seq.block_hashes[index]
            if block_hash not in self.cached:  # a duplicate of a cached block stays anonymous
                self.cached[block_hash] = block_id
                self.block_hashes[block_id] = block_hash
                self.events.stored(block_hash)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its tail blocks become the first candidates for eviction."""
        for block_id in reversed(seq.block_table):
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed twice ({seq.request_id})")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self._empty.append(block_id)
                else:
                    self._evictable[block_id] = None
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
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        return copies

    def forget_cached(self) -> None:
        """Evict every cached block no sequence holds (each reported removed)."""
        while self._evictable:
            self._empty.append(self._evict_oldest())

    # -- internals --------------------------------------------------------------------------
    def _lookup(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(block id, hash) of the cached full blocks that prefix `token_ids[:-1]`."""
        hashes = hash_full_blocks(token_ids[:-1], self.block_size, self.model_id)
        hits = []
        for block_hash in hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append((block_id, block_hash))
        return hits

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
        del self.cached[block_hash]
        self.block_hashes[block_id] = None
        self.events.removed(block_hash)
        self.evictions += 1
        return block_id
