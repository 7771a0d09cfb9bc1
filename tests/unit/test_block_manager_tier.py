"""The block manager with a second tier, driven by hypothesis: a fake tier stands for the
KV of each block as the token prefix it was computed from. Whatever is evicted, stored,
refused or lost, every block a sequence is admitted with holds its own prefix's KV, the
blocks are all accounted for, and an admission `can_allocate` allowed always gets room."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shared.engine.block_hash import hash_full_blocks
from shared.engine.block_manager import BlockManager
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import Sequence

BS = 2
NUM_BLOCKS = 8
MODEL_ID = "tiny"


class FakeTier:
    """KV as token prefixes: `kv[block id]` is the prefix a block's KV was computed from."""

    def __init__(self, kv: dict[int, tuple[int, ...]], data: st.DataObject) -> None:
        self.kv = kv
        self.data = data
        self.stored: dict[int, tuple[int, ...]] = {}
        self.loaded = 0

    def save(self, evicted: list[tuple[int, int]]) -> None:
        for block_id, block_hash in evicted:  # still their own KV: not written again yet
            content = self.kv[block_id]
            assert hash_full_blocks(list(content), BS, MODEL_ID)[-1] == block_hash, "wrong KV"
            if self.data.draw(st.integers(0, 3), label="written"):  # 0: the writer was behind
                self.stored[block_hash] = content

    def asked(self, hashes: list[int]) -> None:
        pass  # this tier writes what the draws say, returns or not

    def held_run(self, hashes: list[int]) -> int:
        count = 0
        while count < len(hashes) and hashes[count] in self.stored:
            count += 1
        return count

    def pays(self) -> bool:
        return True

    def skip(self, num_blocks: int) -> None:
        raise AssertionError("a tier that always pays skips nothing")

    def load(self, block_ids: list[int], hashes: list[int]) -> int:
        every = st.just(len(hashes))
        good = self.data.draw(every | st.integers(0, len(hashes)), label="loaded")  # refused
        for block_id, block_hash in zip(block_ids[:good], hashes, strict=False):
            self.kv[block_id] = self.stored[block_hash]
        for block_hash in hashes[good : good + 1]:
            del self.stored[block_hash]  # a refused entry is removed
        self.loaded += good
        return good


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_admitted_blocks_hold_their_own_prefix_whatever_the_tier_does(data):
    kv: dict[int, tuple[int, ...]] = {}
    tier = FakeTier(kv, data)
    bm = BlockManager(NUM_BLOCKS, BS, MODEL_ID, tier=tier)  # type: ignore[arg-type]
    live: list[Sequence] = []
    history: list[list[int]] = [[]]
    for step in range(40):
        base = data.draw(st.sampled_from(history), label="base")  # often a whole earlier turn
        keep = data.draw(st.just(len(base)) | st.integers(0, len(base)), label="keep")
        extra = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4), label="extra")
        seq = Sequence(f"s{step}", base[:keep] + extra, keep + len(extra), SamplingParams(), 0)
        budget = data.draw(st.integers(1, 8), label="budget")
        if bm.can_allocate(seq, budget):
            bm.allocate(seq)
            for index in range(seq.num_cached_tokens // BS):  # pool or tier: its own KV
                assert kv[seq.block_table[index]] == tuple(seq.token_ids[: (index + 1) * BS])
            num_tokens = min(seq.num_uncomputed_tokens, budget, bm.room(seq))
            assert num_tokens >= 1
            bm.allocate_slots(seq, num_tokens)
            seq.num_computed_tokens += num_tokens
            for index, block_id in enumerate(seq.block_table):  # the step computes the KV
                kv[block_id] = tuple(
                    seq.token_ids[: min((index + 1) * BS, seq.num_computed_tokens)]
                )
            bm.commit(seq)
            live.append(seq)
            history.append(list(seq.token_ids))
        while live and data.draw(st.booleans(), label="free"):
            bm.free(live.pop(data.draw(st.integers(0, len(live) - 1), label="which")))
        referenced = {b for s in live for b in s.block_table}
        assert bm.num_free_blocks == NUM_BLOCKS - len(referenced)
        for block_hash, block_id in bm.cached.items():  # what the pool caches is what it holds
            assert hash_full_blocks(list(kv[block_id]), BS, MODEL_ID)[-1] == block_hash
    event(f"blocks loaded from the tier: {min(tier.loaded, 3)}")


class FullTier(FakeTier):
    """Holds every block asked for, and loads them all."""

    def held_run(self, hashes: list[int]) -> int:
        return len(hashes)

    def load(self, block_ids: list[int], hashes: list[int]) -> int:
        self.loaded += len(block_ids)
        return len(block_ids)


def test_a_tier_load_leaves_a_block_for_the_token_computed_after_it():
    bm = BlockManager(4, BS, MODEL_ID, tier=FullTier({}, None))  # type: ignore[arg-type]
    seq = Sequence("s", list(range(9)), 9, SamplingParams(), 0)  # 4 full blocks, then 1 token
    # the whole prompt takes 5 blocks: admitted by its first chunk (chunked prefill)
    assert not bm.can_allocate(seq, token_budget=8)
    assert bm.can_allocate(seq, token_budget=BS)
    bm.allocate(seq)
    assert seq.num_cached_tokens == 3 * BS  # not 4 blocks: the pool has only 4
    assert bm.room(seq) == BS
    bm.allocate_slots(seq, min(seq.num_uncomputed_tokens, bm.room(seq)))
