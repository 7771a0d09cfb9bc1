"""The `fake` KV transport (and the READ planning it shares with `nixl`), in one process, and
the link that picks each transfer's sender and receiver."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
import torch

from shared.engine.errors import InvalidRequest, UnknownRequest
from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.fake_transport import FakeFabric, FakeTransport, ReadFault
from shared.kvtransfer.link import KVLink, KVReceivers
from shared.kvtransfer.read_plan import BlockRun, block_runs
from shared.kvtransfer.transfer import TransferState
from shared.protocol import KVChunk, KVReady

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def cache(num_blocks: int, fill: float | None) -> list[torch.Tensor]:
    """[num_blocks, 4, 2, 2, 8] per layer: random, or `fill` everywhere."""
    shape = [num_blocks, *LAYOUT.block_shape]
    if fill is None:
        return [torch.randn(shape) for _ in range(LAYOUT.num_layers)]
    return [torch.full(shape, fill) for _ in range(LAYOUT.num_layers)]


@pytest.fixture
def mesh() -> tuple[FakeFabric, FakeTransport, FakeTransport]:
    fabric = FakeFabric()
    prefill = FakeTransport("prefill-0", cache(16, None), LAYOUT, fabric)
    decode = FakeTransport("decode-0", cache(8, -1.0), LAYOUT, fabric)
    decode.connect("prefill-0", prefill.metadata(), prefill.num_blocks)
    return fabric, prefill, decode


def test_read_copies_exactly_the_asked_blocks_of_every_layer(mesh) -> None:
    _, prefill, decode = mesh
    handle = decode.start_read("prefill-0", [3, 7, 8, 15], [0, 1, 2, 5])
    assert handle.poll() == TransferState.SUCCESS
    for mine, theirs in zip(decode.layers, prefill.layers, strict=True):
        assert torch.equal(mine[[0, 1, 2, 5]], theirs[[3, 7, 8, 15]])
        assert torch.equal(mine[[3, 4, 6, 7]], torch.full_like(mine[[3, 4, 6, 7]], -1.0))


@pytest.mark.parametrize(
    ("remote", "local"),
    [([16], [0]), ([-1], [0]), ([1, 2], [0]), ([1], [8]), ([1, 2], [3, 3])],
)
def test_bad_ids_are_refused_before_any_byte_changes(mesh, remote, local) -> None:
    _, _, decode = mesh
    before = [layer.clone() for layer in decode.layers]
    with pytest.raises(ValueError):
        decode.start_read("prefill-0", remote, local)
    assert all(torch.equal(a, b) for a, b in zip(decode.layers, before, strict=True))


def test_unknown_peer_and_forged_metadata_are_refused(mesh) -> None:
    fabric, prefill, decode = mesh
    with pytest.raises(ValueError, match="unknown peer"):
        decode.start_read("prefill-1", [0], [0])
    with pytest.raises(ValueError):
        decode.connect("prefill-0", b"prefill-1", prefill.num_blocks)
    with pytest.raises(ValueError, match="blocks"):
        decode.connect("prefill-0", prefill.metadata(), 64)
    other = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    odd = FakeTransport("odd", [t.bfloat16() for t in cache(4, 0.0)], other, fabric)
    with pytest.raises(ValueError, match="layout"):
        decode.connect("odd", odd.metadata(), odd.num_blocks)


def test_cache_that_does_not_fit_its_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="cache tensors"):
        FakeTransport("x", cache(4, 0.0)[:2], LAYOUT, FakeFabric())
    with pytest.raises(ValueError, match="contiguous float32"):
        FakeTransport("x", [t.double() for t in cache(4, 0.0)], LAYOUT, FakeFabric())


def test_failed_read_writes_nothing_and_says_why(mesh) -> None:
    fabric, _, decode = mesh
    fabric.set_fault("prefill-0", ReadFault.FAIL)
    handle = decode.start_read("prefill-0", [1, 2], [1, 2])
    assert handle.poll() == TransferState.FAILED
    assert handle.error == "injected failure"
    assert torch.equal(decode.layers[0][1:3], torch.full_like(decode.layers[0][1:3], -1.0))


def test_stalled_read_stays_in_flight_until_resumed(mesh) -> None:
    fabric, prefill, decode = mesh
    fabric.set_fault("prefill-0", ReadFault.STALL)
    handle = decode.start_read("prefill-0", [4], [4])
    assert [handle.poll() for _ in range(3)] == [TransferState.TRANSFERRING] * 3
    fabric.set_fault("prefill-0", ReadFault.NONE)
    assert handle.poll() == TransferState.SUCCESS
    assert torch.equal(decode.layers[2][4], prefill.layers[2][4])


def test_read_from_a_peer_that_went_away_fails(mesh) -> None:
    fabric, prefill, decode = mesh
    fabric.set_fault("prefill-0", ReadFault.STALL)
    handle = decode.start_read("prefill-0", [0], [0])
    prefill.close()
    fabric.set_fault("prefill-0", ReadFault.NONE)
    assert handle.poll() == TransferState.FAILED
    assert "gone" in handle.error
    released = decode.start_read("prefill-0", [0], [0])
    released.release()
    assert released.poll() == TransferState.FAILED


def test_block_runs_merge_ids_consecutive_on_both_sides() -> None:
    assert block_runs([3, 7, 8, 9], [0, 1, 2, 5]) == [
        BlockRun(3, 0, 1),
        BlockRun(7, 1, 2),
        BlockRun(9, 5, 1),
    ]
    assert block_runs(list(range(10, 20)), list(range(10))) == [BlockRun(10, 0, 10)]
    assert block_runs([], []) == []


def test_make_transport_falls_back_to_nats_unless_nixl_is_insisted_on(monkeypatch, caplog) -> None:
    from shared.kvtransfer import select
    from shared.kvtransfer.transfer import TransportUnavailable

    assert select.make_transport("w", cache(2, 0.0), LAYOUT, "nats") is None
    monkeypatch.setattr(select, "nixl_available", lambda: (False, "no libucp here"))
    with caplog.at_level("WARNING", logger=select.__name__):
        assert select.make_transport("w", cache(2, 0.0), LAYOUT, "auto") is None
    assert [r.getMessage() for r in caplog.records] == [
        "NIXL unavailable (no libucp here): KV moves over NATS"
    ]
    with pytest.raises(TransportUnavailable, match="no libucp here"):
        select.make_transport("w", cache(2, 0.0), LAYOUT, "nixl")
    with pytest.raises(ValueError, match="one of"):
        select.make_transport("w", cache(2, 0.0), LAYOUT, "rdma")


class Reservation:
    """The decode side as receivers see it: one reservation of 4 blocks (the first cached),
    whose receiver's states are logged."""

    def __init__(self) -> None:
        self.request = SimpleNamespace(request_id="r", num_blocks=4, skip_blocks=1, receiver=None)
        self.states: list[TransferState] = []

    def awaiting(self, request_id: str) -> SimpleNamespace:
        if request_id != "r":
            raise UnknownRequest(f"no reservation for {request_id!r}")
        return self.request

    def on_receive(self, request: SimpleNamespace, state: TransferState) -> None:
        self.states.append(state)

    def reserved(self, request_id: str, first_block: int, hashes: list[int | None]) -> list[int]:
        return [4, 5, 6][first_block - 1 :][: len(hashes)]

    @contextlib.asynccontextmanager
    async def pinned(self, request_id: str) -> AsyncIterator[None]:
        yield


def test_the_link_picks_each_transfers_sender_and_receiver(mesh) -> None:
    """Senders by what both ends take; receivers by a transfer's first message, which a
    one-sided receiver READs into the reserved blocks."""
    _, prefill, decode = mesh
    reservation = Reservation()
    bus = SimpleNamespace(max_payload=1 << 20)
    link = KVLink(bus, "decode-0", LAYOUT, 4, 1024, reservation, None, decode)  # type: ignore[arg-type]
    assert link.names == ["fake"]  # no copier: no nats
    assert link.sender("r", 9, "kv", ["fake", "nats"], 0.0).name == "fake"
    assert link.sender("r", 9, "kv", ["nixl", "nats"], 0.0).name == "nats"
    ready = KVReady(
        "r", "fake", "prefill-0", prefill.metadata(), prefill.num_blocks,
        [LAYOUT.num_layers, *LAYOUT.block_shape], LAYOUT.dtype,
        1, [3, 7, 8], [None] * 3, 9, time.time() + 10,
    )  # fmt: skip
    asyncio.run(KVReceivers(link, reservation).on_ready(ready, {"traceparent": "x"}))
    receiver = reservation.request.receiver
    assert receiver.name == "fake" and receiver.poll() == TransferState.SUCCESS
    assert reservation.states == [TransferState.TRANSFERRING, TransferState.SUCCESS]
    assert (receiver.received.first_token_id, receiver.received.num_blocks) == (9, 3)
    for mine, theirs in zip(decode.layers, prefill.layers, strict=True):
        assert torch.equal(mine[[4, 5, 6]], theirs[[3, 7, 8]])
    reservation.request.receiver = None
    chunk = KVChunk("r", 0, 0, 1, 1, [None], LAYOUT.dtype, [1, 1, *LAYOUT.block_shape], b"")
    with pytest.raises(InvalidRequest, match="copies no KV"):  # nats, without a copier
        asyncio.run(KVReceivers(link, reservation).on_chunk(chunk, {}))
    assert reservation.request.receiver.name == "nats" and len(reservation.states) == 2
