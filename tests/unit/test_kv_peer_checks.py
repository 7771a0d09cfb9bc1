"""What a reading worker checks of a holder's pin (shared/kvtransfer/peer_pin.py), and when
it reads at all (shared/kvtransfer/peer_cost.py)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.peer_cost import PeerReadCost
from shared.kvtransfer.peer_pin import PinRefused, check_pinned
from shared.prefix_messages import PeerFallback, PeerPrefix, PrefixPinned
from shared.protocol import Outcome

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=1, head_dim=4, dtype="float32")
HINT = PeerPrefix("holder", 7, 0, 3)
ASKED = [101, 102, 103]
GOOD = PrefixPinned(
    "r1", Outcome.OK, holder="holder", epoch=7, transport="fake", agent_metadata=b"holder",
    num_cache_blocks=10, layout=[2, 16, 2, 1, 4], dtype="float32", block_ids=[4, 5, 6],
    block_hashes=list(ASKED), read_by=time.time() + 86400,  # made at import: far off
)  # fmt: skip


def check(reply: PrefixPinned, hint: PeerPrefix = HINT) -> int:
    return check_pinned(reply, "r1", hint, ASKED, LAYOUT, "fake")


def test_a_good_pin_reads_its_blocks_and_a_shorter_leading_run_is_taken() -> None:
    assert check(GOOD) == 3
    assert check(replace(GOOD, block_ids=[4, 5], block_hashes=ASKED[:2])) == 2
    assert check(GOOD, replace(HINT, holder_epoch=0)) == 3  # a hint that says no epoch


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"pin_id": "r2"}, PeerFallback.BAD_REPLY),  # an answer to another question
        ({"holder": "other"}, PeerFallback.BAD_REPLY),
        ({"epoch": 8}, PeerFallback.BAD_REPLY),  # a restarted holder: another process
        ({"epoch": 0}, PeerFallback.BAD_REPLY),  # the hint named one; the answer none
        ({"transport": "nixl"}, PeerFallback.BAD_REPLY),
        ({"layout": [3, 16, 2, 1, 4]}, PeerFallback.BAD_REPLY),
        ({"dtype": "bfloat16"}, PeerFallback.BAD_REPLY),
        ({"block_hashes": [101, 999, 103]}, PeerFallback.BAD_REPLY),  # forged hashes
        ({"block_ids": [4, 5], "block_hashes": [102, 103]}, PeerFallback.BAD_REPLY),  # not leading
        ({"block_ids": [4, 5, 10]}, PeerFallback.BAD_REPLY),  # outside its cache
        ({"block_ids": [4, 4, 5]}, PeerFallback.BAD_REPLY),
        ({"block_ids": [], "block_hashes": []}, PeerFallback.BAD_REPLY),
        ({"block_ids": [1, 2, 3, 4], "block_hashes": ASKED + [104]}, PeerFallback.BAD_REPLY),
        ({"outcome": Outcome.UNAVAILABLE, "error": "gone"}, PeerFallback.PIN_REFUSED),
        ({"read_by": time.time() - 1}, PeerFallback.READ_LATE),  # stale: expired already
    ],
)
def test_a_stale_forged_or_refused_pin_is_not_read(change: dict, reason: PeerFallback) -> None:
    with pytest.raises(PinRefused) as refused:
        check(replace(GOOD, **change))
    assert refused.value.reason == reason


def test_reads_are_made_until_measured_then_only_when_cheaper_than_computing() -> None:
    cost = PeerReadCost()
    assert cost.pays(10**6, 16, prefill_rate=1000.0)  # nothing measured: read, to measure
    cost.observe(fixed_s=0.001, num_bytes=10**6, read_s=0.01)  # 100 MB/s
    assert cost.seconds(10**6) == pytest.approx(0.011)
    assert cost.pays(10**6, 64, prefill_rate=1000.0)  # 11 ms < 64 ms of prefill
    assert not cost.pays(10**6, 8, prefill_rate=1000.0)  # 11 ms > 8 ms
    assert cost.pays(10**6, 8, prefill_rate=0.0)  # prefill not measured yet
