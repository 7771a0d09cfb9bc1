"""The tier's entries, store and writer without an engine: forged, stale and truncated
entries refused; the size limit; stopped engines' directories emptied; a full disk."""

from __future__ import annotations

import errno
import fcntl
import logging
import threading
from pathlib import Path

import pytest
import torch

from shared.engine.kv_tier.entry import (
    BadEntry,
    Buffer,
    Refusal,
    TierLayout,
    decode_entry,
    entry_parts,
)
from shared.engine.kv_tier.policy import LoadPolicy
from shared.engine.kv_tier.store import LOCK_NAME, TierStore
from shared.engine.kv_tier.writer import TierWriter

LAYOUT = TierLayout("tiny", "float32", 4, (2, 4, 2, 1, 2), 4)  # 128 bytes a block
PAYLOAD = bytes(range(128))


def encode_entry(layout: TierLayout, block_hash: int, payload: bytes) -> bytes:
    """The whole file of an entry."""
    return b"".join(entry_parts(layout, block_hash, [payload]))


def blocks(count: int) -> torch.Tensor:
    """`count` blocks as the pool's gather gives them: [layers, count, 4, 2, 1, 2]."""
    return torch.arange(count * 32, dtype=torch.float32).view(count, 2, 4, 2, 1, 2).transpose(0, 1)


def refusal(layout: TierLayout, block_hash: int, data: bytes) -> Refusal:
    with pytest.raises(BadEntry) as caught:
        decode_entry(layout, block_hash, data)
    return caught.value.refusal


def test_an_entry_round_trips():
    assert decode_entry(LAYOUT, 7, encode_entry(LAYOUT, 7, PAYLOAD)) == PAYLOAD


@pytest.mark.parametrize(
    "other",
    [
        TierLayout("other-model", "float32", 4, (2, 4, 2, 1, 2), 4),
        TierLayout("tiny", "bfloat16", 4, (2, 4, 2, 1, 4), 2),  # same bytes, other dtype
        TierLayout("tiny", "float32", 4, (2, 4, 2, 2, 1), 4),  # same size, other layout
    ],
    ids=["model", "dtype", "layout"],
)
def test_an_entry_of_another_model_dtype_or_layout_is_foreign(other):
    assert refusal(other, 7, encode_entry(LAYOUT, 7, PAYLOAD)) == Refusal.FOREIGN


def test_forged_truncated_and_stale_entries_are_refused():
    entry = encode_entry(LAYOUT, 7, PAYLOAD)
    assert refusal(LAYOUT, 8, entry) == Refusal.OTHER_BLOCK  # copied under another hash
    assert refusal(LAYOUT, 7, entry[:-1]) == Refusal.TRUNCATED
    assert refusal(LAYOUT, 7, entry[:10]) == Refusal.TRUNCATED
    assert refusal(LAYOUT, 7, b"XXXX" + entry[4:]) == Refusal.NOT_AN_ENTRY
    forged = bytearray(entry)
    forged[-5] ^= 0x01  # the payload changed, the checksum not
    assert refusal(LAYOUT, 7, bytes(forged)) == Refusal.CHECKSUM


def test_the_store_keeps_the_most_recently_used_under_its_size(tmp_path):
    entry_size = len(encode_entry(LAYOUT, 1, PAYLOAD))
    store = TierStore(tmp_path, 2 * entry_size, LAYOUT)
    for block_hash in (1, 2):
        assert store.put(block_hash, [encode_entry(LAYOUT, block_hash, PAYLOAD)])
    assert store.get(1) is not None  # 2 is now the least recently used
    store.put(3, entry_parts(LAYOUT, 3, [PAYLOAD[:50], PAYLOAD[50:]]))  # written in pieces
    assert (store.holds(1), store.holds(2), store.holds(3)) == (True, False, True)
    assert store.evictions == 1 and store.stored_bytes == 2 * entry_size
    assert len(list(store.path.glob("*.kv"))) == 2
    assert decode_entry(LAYOUT, 3, store.get(3) or b"") == PAYLOAD
    assert not store.put(3, [encode_entry(LAYOUT, 3, PAYLOAD)])  # already stored
    events = store.take_events()  # 2 was stored and evicted since the last take: never heard of
    assert (sorted(events.stored), events.removed) == ([1, 3], [])
    store.discard(1)
    assert store.take_events().removed == [1]


def test_a_file_removed_under_the_store_is_a_miss(tmp_path):
    store = TierStore(tmp_path, 1 << 20, LAYOUT)
    store.put(1, [encode_entry(LAYOUT, 1, PAYLOAD)])
    next(store.path.glob("*.kv")).unlink()
    assert store.get(1) is None and not store.holds(1)


def test_a_stopped_engines_directory_is_emptied_and_a_live_ones_kept(tmp_path):
    stale = tmp_path / "0123456789abcdef.dead"
    stale.mkdir()
    (stale / LOCK_NAME).touch()
    (stale / "0000000000000001.kv").write_bytes(b"old")
    live = TierStore(tmp_path, 1 << 20, LAYOUT)
    live.put(1, [encode_entry(LAYOUT, 1, PAYLOAD)])
    other = TierStore(tmp_path, 1 << 20, LAYOUT)  # another worker sharing the root
    assert not stale.exists()
    assert live.holds(1) and live.path.exists() and other.path != live.path
    live.close()
    assert not live.path.exists()
    with open(other.path / LOCK_NAME, "rb") as lock_file, pytest.raises(BlockingIOError):
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_full_disk_stops_writing_and_says_so_once(tmp_path, caplog):
    def full(path: Path, parts: list[Buffer]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = TierWriter(TierStore(tmp_path, 1 << 20, LAYOUT, write=full), LAYOUT)
    with caplog.at_level(logging.ERROR, logger="shared.engine.kv_tier.writer"):
        assert writer.offer([1, 2], blocks(2))
        assert writer.flush()
        assert writer.stopped and writer.room() == 0 and not writer.offer([3], blocks(1))
    assert sum("stopped writing" in r.message for r in caplog.records) == 1
    assert writer.bytes_written == 0


def test_offers_beyond_the_queue_are_dropped_and_counted(tmp_path):
    release = threading.Event()

    def slow(path: Path, parts: list[Buffer]) -> None:
        release.wait(10)
        path.write_bytes(b"".join(parts))

    writer = TierWriter(TierStore(tmp_path, 1 << 20, LAYOUT, write=slow), LAYOUT, depth=3)
    assert writer.offer([1, 2], blocks(2)) and writer.room() == 1
    assert not writer.offer([3, 4], blocks(2))  # 4 blocks > 3: refused whole, counted
    assert writer.dropped == 2
    release.set()
    assert writer.flush() and writer.room() == 3
    assert writer.bytes_written > 0 and writer.dropped == 2


def test_each_block_of_an_offer_is_stored_as_its_own_entry(tmp_path):
    store = TierStore(tmp_path, 1 << 20, LAYOUT)
    writer = TierWriter(store, LAYOUT)
    offered = blocks(3)
    assert writer.offer([7, 8, 9], offered) and writer.flush()
    for index, block_hash in enumerate([7, 8, 9]):
        payload = decode_entry(LAYOUT, block_hash, store.get(block_hash) or b"")
        expected = offered[:, index].contiguous().view(torch.uint8).numpy().tobytes()
        assert payload == expected


def test_loading_is_chosen_only_while_it_is_cheaper():
    policy = LoadPolicy(block_size=16)
    assert policy.pays()  # nothing measured: the first loads measure the tier
    policy.prefill_rate = 1600.0  # 10 ms to recompute a block
    policy.observe_load(seconds=0.002, num_blocks=2)
    assert policy.pays()
    for _ in range(20):
        policy.observe_load(seconds=0.1, num_blocks=2)  # the tier got slow: 50 ms a block
    assert not policy.pays()
    policy.prefill_rate = 100.0  # a busy engine: 160 ms to recompute a block
    assert policy.pays()
