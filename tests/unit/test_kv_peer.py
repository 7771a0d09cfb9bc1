"""Prefix blocks read from another engine's pool (shared/engine/kv_tier/peer.py) over the
`fake` transport: the reader's logits are the same bit for bit as an engine that holds the
prefix itself; the holder's pinned blocks are never evicted meanwhile; a lost READ leaves
the reader's pool as it was."""

from __future__ import annotations

import torch

from shared.engine.block_hash import hash_full_blocks
from shared.engine.block_manager import BlockManager
from shared.engine.engine import LLMEngine
from shared.engine.kv_tier.peer import adopt_read, take_for_peer
from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.fake_transport import FakeFabric, FakeTransport, ReadFault
from shared.kvtransfer.transfer import TransferState
from tests.engine_harness import LogitsRecorder
from tests.unit.test_kv_tier import PROMPT, make_engine, reference, run

NUM_FULL = 4  # PROMPT's full blocks before its last token


def transport(engine: LLMEngine, name: str, fabric: FakeFabric) -> FakeTransport:
    model = engine.model_config
    layout = KVLayout(
        model.num_layers, engine.config.block_size, model.num_kv_heads, model.head_dim, "float32"
    )
    return FakeTransport(name, engine.kv.layers(), layout, fabric)


def read(reader: LLMEngine, holder: LLMEngine, fabric: FakeFabric) -> int:
    """The reader reads PROMPT's prefix from the holder as a worker does; blocks read."""
    mine, theirs = transport(reader, "reader", fabric), transport(holder, "holder", fabric)
    take = take_for_peer(reader.block_manager, PROMPT, "", NUM_FULL)
    assert take is not None and take.first_block == 0
    pinned = holder.block_manager.pin_cached(take.block_hashes)
    mine.connect("holder", theirs.metadata(), theirs.num_blocks)
    handle = mine.start_read("holder", pinned, take.block_ids[: len(pinned)])
    state = handle.poll()
    handle.release()
    holder.block_manager.unpin(pinned)
    num_read = len(pinned) if state == TransferState.SUCCESS else 0
    adopt_read(reader.block_manager, take, num_read)
    return num_read


def test_a_prefix_read_from_a_peer_gives_the_same_logits_bit_for_bit(tiny_model_dir, tmp_path):
    tokens, rows = reference(tiny_model_dir, tmp_path)  # the prefix held in the pool
    computed = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=64)
    assert run(computed, "computed", PROMPT) == tokens  # and computed, the same tokens
    holder = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=64)
    run(holder, "first", PROMPT)
    reader = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=64)
    assert read(reader, holder, FakeFabric()) == NUM_FULL
    hashes = hash_full_blocks(PROMPT[:-1], 16, "")
    assert set(hashes) <= set(reader.take_kv_events().stored)  # the scheduler hears of them
    recorder = LogitsRecorder(reader)
    assert run(reader, "again", PROMPT) == tokens
    assert reader.stats().prefix_hits == NUM_FULL * 16  # computed only the rest
    assert rows.keys() == recorder.rows.keys()
    for key, row in rows.items():
        assert torch.equal(recorder.rows[key], row), key
    bm = holder.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every pin let go


def test_a_lost_read_gives_the_blocks_back_and_the_prompt_is_computed(tiny_model_dir, tmp_path):
    tokens, _ = reference(tiny_model_dir, tmp_path)
    holder = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=64)
    run(holder, "first", PROMPT)
    reader = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=64)
    fabric = FakeFabric()
    fabric.set_fault("holder", ReadFault.FAIL)
    assert read(reader, holder, fabric) == 0
    bm = reader.block_manager
    assert not bm.cached and bm.num_free_blocks == bm.num_blocks
    assert not reader.take_kv_events().stored
    assert run(reader, "again", PROMPT) == tokens
    assert reader.stats().prefix_hits == 0


def test_pinned_blocks_are_not_evicted_and_unpin_frees_them() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.adopt(bm.take_blocks(3), [11, 12, 13])  # three cached, free blocks
    assert bm.num_free_blocks == 4 and set(bm.cached) == {11, 12, 13}
    assert bm.pin_cached([11, 12, 99, 13]) == [bm.cached[11], bm.cached[12]]  # a leading run
    assert bm.num_free_blocks == 2
    fresh = bm.take_blocks(2)  # the empty one, then the only evictable one: 13
    assert 13 not in bm.cached and {11, 12} <= set(bm.cached)
    bm.unpin([bm.cached[11], bm.cached[12]])
    bm.unpin(fresh)
    assert bm.num_free_blocks == 4


def test_adopting_a_hash_already_cached_gives_the_block_back() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.adopt(bm.take_blocks(1), [11])
    first = bm.cached[11]
    bm.adopt(bm.take_blocks(1), [11])
    assert bm.cached == {11: first} and bm.num_free_blocks == 4


def test_nothing_is_taken_when_the_pool_holds_the_prefix_or_cannot_fit_the_prompt(
    tiny_model_dir, tmp_path
):
    engine = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=64)
    run(engine, "first", PROMPT)
    held = take_for_peer(engine.block_manager, PROMPT, "", NUM_FULL)
    assert held is not None and held.first_block == NUM_FULL and not held.block_ids  # all held
    small = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=4)  # PROMPT needs 5 blocks
    assert take_for_peer(small.block_manager, PROMPT, "", NUM_FULL) is None
    assert small.block_manager.num_free_blocks == 4
