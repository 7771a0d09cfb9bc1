"""vLLM's KV cache events as our block hashes (vllm_kv_events.py), and their way from vLLM's
own ZMQ publisher to the worker (vllm_kv_subscriber.py), without starting an engine."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make install ENGINE=vllm)")

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from services.worker.vllm_kv_events import VllmKVEventTranslator
from services.worker.vllm_kv_subscriber import VllmKVEventSubscriber
from shared.engine.block_hash import hash_full_blocks

SIZE = 4
MODEL = "smol"
TOKENS = list(range(100, 100 + 3 * SIZE + 2))  # three full blocks and a partial one
OURS = hash_full_blocks(TOKENS, SIZE, MODEL)


def stored(hashes: list, tokens: list[int], parent=None, **fields) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=fields.pop("block_size", SIZE),
        lora_id=None,
        medium=fields.pop("medium", "GPU"),
        lora_name=None,
        **fields,
    )


def removed(hashes: list) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium="GPU")


def translator() -> VllmKVEventTranslator:
    return VllmKVEventTranslator(SIZE, MODEL)


def test_stored_blocks_get_our_hashes_chained_through_vllms_parents():
    t = translator()
    # vLLM caches the first block, then the next two in a later step (parent: its hash).
    t.apply([stored([b"v0"], TOKENS[:SIZE])])
    t.apply([stored([b"v1", b"v2"], TOKENS[SIZE : 3 * SIZE], parent=b"v0")])
    events = t.take()
    assert events.stored == OURS and len(OURS) == 3
    assert events.removed == []
    assert t.take().stored == []  # reported once


def test_removed_blocks_map_back_and_all_cleared_removes_everything():
    t = translator()
    t.apply([stored([b"v0", b"v1", b"v2"], TOKENS[: 3 * SIZE])])
    t.take()
    t.apply([removed([b"v2"]), removed([b"never-stored"])])
    assert t.take().removed == [OURS[2]]
    t.apply([AllBlocksCleared()])
    events = t.take()
    assert sorted(events.removed) == sorted(OURS[:2]) and events.stored == []
    # The map is empty after the clear: a late removal of an old hash reports nothing.
    t.apply([removed([b"v0"])])
    assert t.take().removed == []


def test_an_unknown_parent_skips_the_blocks_and_their_children():
    t = translator()
    t.apply([stored([b"v1"], TOKENS[SIZE : 2 * SIZE], parent=b"missed")])
    t.apply([stored([b"v2"], TOKENS[2 * SIZE : 3 * SIZE], parent=b"v1")])
    assert t.take().stored == [] and t.num_skipped == 2
    t.apply([removed([b"v1"])])
    assert t.take().removed == []


def test_blocks_we_cannot_hash_our_way_are_skipped():
    t = translator()
    t.apply([stored([b"p"], TOKENS[:2], block_size=2)])  # a partial-block entry
    t.apply([stored([b"c"], TOKENS[:SIZE], medium="CPU")])  # an offloading tier
    t.apply([stored([b"s"], TOKENS[:SIZE], extra_keys=[("salt",)])])  # keys we do not hash
    t.apply([stored([b"x", b"y"], TOKENS[: SIZE + 1])])  # not a whole number of blocks
    assert t.take().stored == [] and t.num_skipped == 5


def test_one_hash_in_several_blocks_is_removed_with_the_last():
    t = translator()
    t.apply([stored([b"v0"], TOKENS[:SIZE]), stored([b"v0"], TOKENS[:SIZE])])
    t.apply([stored([b"w0"], TOKENS[:SIZE], group_idx=1)])  # another KV cache group
    assert t.take().stored == OURS[:1]
    t.apply([removed([b"v0"]), removed([b"v0"])])
    assert t.take().removed == []  # group 1 still holds it
    t.apply([BlockRemoved(block_hashes=[b"w0"], medium="GPU", group_idx=1)])
    assert t.take().removed == OURS[:1]


def test_stored_then_removed_within_one_beat_is_never_reported():
    t = translator()
    t.apply([stored([b"v0"], TOKENS[:SIZE]), removed([b"v0"])])
    events = t.take()
    assert events.stored == [] and events.removed == []


def drain_until(subscriber: VllmKVEventSubscriber, count: int) -> list[int]:
    got: list[int] = []
    give_up = time.monotonic() + 10
    while len(got) < count and time.monotonic() < give_up:
        subscriber.drain()
        got += subscriber.translator.take().stored
        time.sleep(0.01)
    return got


def test_batches_from_vllms_publisher_reach_the_subscriber_and_a_gap_clears():
    subscriber = VllmKVEventSubscriber(translator())
    config = subscriber.events_config()
    publisher = ZmqEventPublisher(0, endpoint=config.endpoint, topic=config.topic)
    try:
        time.sleep(0.2)  # the subscription reaches the publisher (ZMQ's slow joiner)
        batch = KVEventBatch(ts=time.time(), events=[stored([b"v0", b"v1"], TOKENS[: 2 * SIZE])])
        publisher.publish(batch)
        assert drain_until(subscriber, 2) == OURS[:2]
        publisher._seq_gen = iter(range(5, 10))  # batches 1..4 "dropped"
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        give_up = time.monotonic() + 10
        while not subscriber.num_gaps and time.monotonic() < give_up:
            subscriber.drain()
            time.sleep(0.01)
        assert subscriber.num_gaps == 1
        assert sorted(subscriber.translator.take().removed) == sorted(OURS[:2])
    finally:
        publisher.shutdown()
        subscriber.close()
