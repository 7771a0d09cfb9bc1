"""The block manager and its prefix cache, driven by a hypothesis state machine.

Beside the allocator the machine keeps its own model: each block's reference count, the
token prefix whose KV each block holds, which prefixes are cached, and the order in which
unreferenced cached blocks were released. After every step the allocator must agree with it:
no block leaked or counted twice, hashes that chain, empty blocks handed out before any
cached one is evicted, eviction least recently released first, and the predicted prefix hits.
A subscriber fed only the KV cache events, taken at random moments, knows the cached hashes.
"""

from __future__ import annotations

from collections import Counter
from itertools import count

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.engine.block_hash import ROOT_HASH, hash_block, hash_full_blocks
from shared.engine.block_manager import BlockManager
from shared.engine.errors import OutOfBlocks
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import Sequence

BS = 2  # block size
NUM_BLOCKS = 10
MODEL_ID = "tiny"
VOCAB = 3  # few token ids, so blocks repeat and commits meet duplicates

picks = st.integers(0, 10**6)  # index into a list, taken modulo its length
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)


def make_seq(name: str, token_ids: list[int]) -> Sequence:
    return Sequence(name, list(token_ids), len(token_ids), SamplingParams(), seed=0)


def prefix_hash(prefix: tuple[int, ...]) -> int:
    return hash_full_blocks(list(prefix), BS, MODEL_ID)[-1]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, MODEL_ID)
        self.live: list[Sequence] = []
        self.history: list[list[int]] = []  # token ids of every sequence added, for prefixes
        self.names = count(1)
        # The model.
        self.refs = [0] * NUM_BLOCKS
        self.kv: list[tuple[int, ...]] = [()] * NUM_BLOCKS  # token prefix each block's KV ends
        self.cached: dict[tuple[int, ...], int] = {}  # full-block prefix -> block holding it
        self.lru: list[int] = []  # unreferenced cached blocks, least recently released first
        self.committed: dict[str, int] = {}  # request id -> blocks its commits have covered
        self.evictions = 0
        self.subscriber: set[int] = set()  # hashes known from the KV cache events alone

    # -- model helpers ----------------------------------------------------------------------
    def _num_free(self) -> int:
        return self.refs.count(0)

    def _handed_out(self, block: int) -> None:
        """The allocator gave out `block`: an empty one if any is left, else the LRU one."""
        empty = [b for b in range(NUM_BLOCKS) if self.refs[b] == 0 and b not in self.lru]
        if empty:
            assert block in empty, f"block {block} handed out while {empty} were empty"
        else:
            assert self.lru and block == self.lru[0], f"evicted {block}, LRU order {self.lru}"
            self.lru.pop(0)
            self.cached = {p: b for p, b in self.cached.items() if b != block}
            self.evictions += 1
        self.refs[block] = 1
        self.kv[block] = ()

    def _expected_hits(self, token_ids: list[int]) -> list[int]:
        hits = []
        for end in range(BS, len(token_ids), BS):  # full blocks of token_ids[:-1]
            block = self.cached.get(tuple(token_ids[:end]))
            if block is None:
                break
            hits.append(block)
        return hits

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        before = list(seq.block_table)
        needed = max(0, -(-(seq.num_computed_tokens + num_tokens) // BS) - len(before))
        if needed > self._num_free():
            with pytest.raises(OutOfBlocks):
                self.bm.allocate_slots(seq, num_tokens)
            assert seq.block_table == before
            return
        self.bm.allocate_slots(seq, num_tokens)
        assert seq.block_table[: len(before)] == before
        assert len(seq.block_table) == len(before) + needed
        for block in seq.block_table[len(before) :]:
            self._handed_out(block)

    # -- rules ------------------------------------------------------------------------------
    @rule(source=picks, keep=st.integers(0, 12), extra=tokens, first=st.integers(1, 12))
    def add(self, source: int, keep: int, extra: list[int], first: int) -> None:
        """Admit a sequence, often sharing a prefix with an earlier one, and give it slots."""
        base = self.history[source % len(self.history)][:keep] if self.history else []
        seq = make_seq(f"s{next(self.names)}", base + extra)
        expected = self._expected_hits(seq.token_ids)
        queries, hits = self.bm.prefix_queries, self.bm.prefix_hits
        self.bm.allocate(seq)
        assert seq.block_table == expected
        assert seq.num_computed_tokens == seq.num_cached_tokens == len(expected) * BS
        assert self.bm.prefix_hits - hits == len(expected) * BS
        assert self.bm.prefix_queries - queries == seq.num_tokens
        for block in expected:
            if self.refs[block] == 0:
                self.lru.remove(block)
            self.refs[block] += 1
        self.committed[seq.request_id] = len(expected)
        self.live.append(seq)
        self.history.append(list(seq.token_ids))
        self._grow(seq, min(first, seq.num_uncomputed_tokens))

    @rule(length=st.integers(4, 2 * NUM_BLOCKS))
    def add_fresh(self, length: int) -> None:
        """Admit unseen tokens and take every free slot: forces eviction of cached blocks."""
        number = next(self.names)
        seq = make_seq(f"s{number}", [VOCAB + 100 * number + i for i in range(length)])
        self.bm.allocate(seq)
        assert seq.block_table == []
        self.committed[seq.request_id] = 0
        self.live.append(seq)
        self._grow(seq, min(length, self._num_free() * BS))

    @precondition(lambda self: self.live)
    @rule(pick=picks, num_tokens=st.integers(1, 8))
    def grow(self, pick: int, num_tokens: int) -> None:
        seq = self.live[pick % len(self.live)]
        if seq.num_uncomputed_tokens:
            self._grow(seq, min(num_tokens, seq.num_uncomputed_tokens))

    @precondition(lambda self: self.live)
    @rule(pick=picks, num_tokens=st.integers(1, 8), sampled=st.integers(0, VOCAB - 1))
    def compute(self, pick: int, num_tokens: int, sampled: int) -> None:
        """Compute tokens into the slots held, commit, and sample a token at the end."""
        seq = self.live[pick % len(self.live)]
        room = min(len(seq.block_table) * BS, seq.num_tokens) - seq.num_computed_tokens
        if room <= 0:
            return
        start = seq.num_computed_tokens
        end = start + min(num_tokens, room)
        seq.num_computed_tokens = end
        self.bm.commit(seq)
        for index in range(start // BS, -(-end // BS)):
            block = seq.block_table[index]
            assert self.refs[block] == 1, f"block {block} is shared but gets new KV"
            self.kv[block] = tuple(seq.token_ids[: min(end, (index + 1) * BS)])
        for index in range(self.committed[seq.request_id], end // BS):
            self.cached.setdefault(tuple(seq.token_ids[: (index + 1) * BS]), seq.block_table[index])
        self.committed[seq.request_id] = end // BS
        if end == seq.num_tokens:
            seq.token_ids.append(sampled)

    @precondition(lambda self: self.live)
    @rule(pick=picks)
    def fork(self, pick: int) -> None:
        parent = self.live[pick % len(self.live)]
        num_full = parent.num_computed_tokens // BS
        tail = parent.block_table[num_full:]
        if len(tail) > self._num_free():
            return  # test_failed_fork_leaves_the_allocator_as_it_was covers this case
        child = make_seq(f"s{next(self.names)}", parent.token_ids)
        copies = self.bm.fork(parent, child)
        assert child.block_table[:num_full] == parent.block_table[:num_full]
        assert copies == list(zip(tail, child.block_table[num_full:], strict=True))
        assert child.num_computed_tokens == parent.num_computed_tokens
        assert child.block_hashes == parent.block_hashes
        for block in parent.block_table[:num_full]:
            self.refs[block] += 1
        for source, block in copies:
            self._handed_out(block)
            self.kv[block] = self.kv[source]  # the caller copies the KV
        self.committed[child.request_id] = self.committed[parent.request_id]
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(pick=picks)
    def free(self, pick: int) -> None:
        """Free tail first; freeing the emptied sequence again changes nothing."""
        seq = self.live.pop(pick % len(self.live))
        for block in reversed(seq.block_table):
            self.refs[block] -= 1
            if self.refs[block] == 0 and block in self.cached.values():
                self.lru.append(block)
        self.bm.free(seq)
        assert seq.block_table == seq.block_hashes == []
        assert seq.num_computed_tokens == 0
        self.bm.free(seq)
        del self.committed[seq.request_id]

    @rule()
    def take_kv_events(self) -> None:
        """Apply the net events since the last take, removals first: the set is exact."""
        events = self.bm.events.take()
        assert not set(events.stored) & set(events.removed)
        assert not set(events.removed) - self.subscriber, "removed what it never stored"
        self.subscriber.difference_update(events.removed)
        self.subscriber.update(events.stored)
        assert self.subscriber == set(self.bm.cached)

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def blocks_are_accounted_for(self) -> None:
        in_tables = Counter(block for seq in self.live for block in seq.block_table)
        assert self.bm.ref_counts == self.refs == [in_tables[b] for b in range(NUM_BLOCKS)]
        assert self.bm.num_free_blocks == self._num_free()
        assert self.bm.evictions == self.evictions

    @invariant()
    def cache_matches_model(self) -> None:
        hashes = {block: prefix_hash(prefix) for prefix, block in self.cached.items()}
        assert self.bm.cached == {h: block for block, h in hashes.items()}
        assert self.bm.block_hashes == [hashes.get(b) for b in range(NUM_BLOCKS)]
        for prefix, block in self.cached.items():
            assert self.kv[block] == prefix  # a cached block holds the KV its hash names

    @invariant()
    def sequences_see_their_own_tokens(self) -> None:
        for seq in self.live:
            parent = ROOT_HASH
            assert len(seq.block_hashes) == seq.num_computed_tokens // BS
            for index, block_hash in enumerate(seq.block_hashes):
                block_tokens = seq.token_ids[index * BS : (index + 1) * BS]
                assert block_hash == hash_block(parent, block_tokens, MODEL_ID)
                parent = block_hash
            for index in range(-(-seq.num_computed_tokens // BS)):
                expected = tuple(seq.token_ids[: min(seq.num_computed_tokens, (index + 1) * BS)])
                assert self.kv[seq.block_table[index]][: len(expected)] == expected


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _computed(bm: BlockManager, name: str, token_ids: list[int]) -> Sequence:
    seq = make_seq(name, token_ids)
    bm.allocate(seq)
    bm.allocate_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return seq


def test_freeing_a_stale_block_table_raises() -> None:
    bm = BlockManager(4, BS, MODEL_ID)
    seq = _computed(bm, "a", [1, 2, 3, 4, 5])
    stale = make_seq("a-again", seq.token_ids)
    stale.block_table = list(seq.block_table)
    bm.free(seq)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(stale)


def test_failed_fork_leaves_the_allocator_as_it_was() -> None:
    bm = BlockManager(6, BS, MODEL_ID)
    bm.free(_computed(bm, "cached", [7, 7, 7, 7, 7]))  # 2 cached blocks, 4 empty, all free
    parent = make_seq("parent", [1, 2, 3, 4, 5, 6, 7])
    bm.allocate(parent)
    bm.allocate_slots(parent, parent.num_tokens)  # takes the 4 empty blocks
    parent.num_computed_tokens = 1  # no full block: a fork copies all 4, and 2 are free
    cached, free = dict(bm.cached), bm.num_free_blocks
    with pytest.raises(OutOfBlocks):
        bm.fork(parent, make_seq("child", parent.token_ids))
    assert bm.num_free_blocks == free
    assert bm.cached == cached, "a fork that fails should not evict the prefix cache"
