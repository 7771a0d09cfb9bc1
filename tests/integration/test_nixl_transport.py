"""The `nixl` transport between two processes, as the workers use it: process A (a spawned
child) registers its cache and hands its metadata over a queue; this process (B) READs.
Over UCX's TCP with A stopped, a READ stays in flight: released, it still lands once A
goes on, which is why `read_blocks` keeps the blocks of a READ it gave up on until it ends.

Skipped where NIXL cannot load or start (the suite still passes there)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="NIXL (nixl-cu13) is not installed")

from shared.kvtransfer.chunks import DTYPES, KVLayout
from shared.kvtransfer.nixl_transport import NixlTransport, nixl_available
from shared.kvtransfer.transfer import TransferError, TransferState, read_blocks

AVAILABLE, WHY = nixl_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"NIXL cannot start here: {WHY}")

NUM_BLOCKS = 64
CTX = mp.get_context("spawn")


def layout_of(dtype: str) -> KVLayout:
    return KVLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=16, dtype=dtype)


def make_cache(layout: KVLayout, seed: int | None) -> list[torch.Tensor]:
    """[NUM_BLOCKS, 16, 2, 2, 16] per layer: random (seeded) or -1 everywhere (seed None)."""
    shape = [NUM_BLOCKS, *layout.block_shape]
    gen = torch.Generator().manual_seed(seed or 0)
    if seed is None:
        return [torch.full(shape, -1.0, dtype=DTYPES[layout.dtype]) for _ in range(4)]
    return [torch.randn(shape, generator=gen).to(DTYPES[layout.dtype]) for _ in range(4)]


def serve_cache(name: str, dtype: str, seed: int, out: mp.Queue, stop: mp.Queue) -> None:
    """Process A: register a seeded cache, publish (metadata, block count), wait for stop."""
    transport = NixlTransport(name, make_cache(layout_of(dtype), seed), layout_of(dtype))
    out.put((transport.metadata(), transport.num_blocks, os.getpid()))
    stop.get()
    transport.close()


@dataclass
class Peer:
    name: str
    metadata: bytes
    num_blocks: int
    pid: int
    process: mp.Process
    stop: mp.Queue
    cache: list[torch.Tensor]  # what A holds: the same seed, made here


def start_peer(name: str, dtype: str, seed: int) -> Peer:
    out, stop = CTX.Queue(), CTX.Queue()
    process = CTX.Process(target=serve_cache, args=(name, dtype, seed, out, stop), daemon=True)
    process.start()
    metadata, num_blocks, pid = out.get(timeout=30)
    return Peer(name, metadata, num_blocks, pid, process, stop, make_cache(layout_of(dtype), seed))


def stop_peer(peer: Peer) -> None:
    if peer.process.is_alive():
        peer.stop.put(None)
    peer.process.join(10)


def wait(handle, timeout: float = 10.0) -> TransferState:
    deadline = time.monotonic() + timeout
    while (state := handle.poll()) == TransferState.TRANSFERRING:
        assert time.monotonic() < deadline, "READ still in flight after its deadline"
        time.sleep(0.001)
    return state


@dataclass
class Reader:
    transport: NixlTransport
    cache: list[torch.Tensor]  # the tensors it registered: READs land in them


def start_reader(name: str, dtype: str) -> Reader:
    cache = make_cache(layout_of(dtype), None)
    return Reader(NixlTransport(name, cache, layout_of(dtype)), cache)


def as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.uint8)


@pytest.fixture(params=["float32", "bfloat16"])
def pair(request) -> Iterator[tuple[Peer, Reader]]:
    dtype = request.param
    peer = start_peer(f"a-{dtype}", dtype, seed=7)
    reader = start_reader(f"b-{dtype}", dtype)
    reader.transport.connect(peer.name, peer.metadata, peer.num_blocks)
    yield peer, reader
    reader.transport.close()
    stop_peer(peer)


def test_read_copies_exactly_the_asked_blocks_of_every_layer(pair) -> None:
    peer, reader = pair
    before = [layer.clone() for layer in reader.cache]
    handle = reader.transport.start_read(peer.name, [3, 7, 8, 9], [0, 1, 2, 5])
    assert wait(handle) == TransferState.SUCCESS, handle.error
    handle.release()
    untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 1, 2, 5)]
    for mine, theirs, old in zip(reader.cache, peer.cache, before, strict=True):
        assert torch.equal(as_bytes(mine[[0, 1, 2, 5]]), as_bytes(theirs[[3, 7, 8, 9]]))
        assert torch.equal(as_bytes(mine[untouched]), as_bytes(old[untouched]))


FORGED = [
    ([3, NUM_BLOCKS], [0, 1]),  # past A's cache
    ([-1], [0]),
    ([3, 4], [0]),  # lengths differ
    ([3], [NUM_BLOCKS]),  # past B's cache
    ([1, 2], [0, 0]),  # one local block twice
]


def test_forged_read_is_refused_before_a_byte_moves(pair) -> None:
    peer, reader = pair
    before = [layer.clone() for layer in reader.cache]
    for remote, local in FORGED:
        with pytest.raises(ValueError):
            reader.transport.start_read(peer.name, remote, local)
    with pytest.raises(ValueError, match="unknown peer"):
        reader.transport.start_read("nobody", [0], [0])
    time.sleep(0.05)  # a READ wrongly posted would have landed by now
    for mine, old in zip(reader.cache, before, strict=True):
        assert torch.equal(as_bytes(mine), as_bytes(old))


def test_connect_refuses_another_layout_and_a_misnamed_agent(pair) -> None:
    peer, reader = pair
    other = "bfloat16" if reader.transport.layout.dtype == "float32" else "float32"
    stranger = start_reader(f"c-{other}", other)
    try:
        with pytest.raises(ValueError, match="layout"):
            stranger.transport.connect(peer.name, peer.metadata, peer.num_blocks)
        with pytest.raises(ValueError, match="not 'someone'"):
            reader.transport.connect("someone", peer.metadata, peer.num_blocks)
    finally:
        stranger.transport.close()
    reader.transport.connect(peer.name, peer.metadata, peer.num_blocks)  # idempotent


def test_read_from_a_killed_peer_fails_and_its_restart_is_readable() -> None:
    """SIGKILL: UCX sees the peer gone (CMA's process_vm_readv fails, or the endpoint's
    error handler fires) and NIXL refuses or fails the READ; nothing is trusted then. A
    restarted peer under the same name, with new metadata, replaces the dead one."""
    peer = start_peer("a-killed", "float32", seed=11)
    reader = start_reader("b-killed", "float32")
    try:
        reader.transport.connect(peer.name, peer.metadata, peer.num_blocks)
        warm = reader.transport.start_read(peer.name, [0], [0])
        assert wait(warm) == TransferState.SUCCESS, warm.error
        warm.release()
        os.kill(peer.pid, signal.SIGKILL)
        peer.process.join(10)
        handle = reader.transport.start_read(peer.name, list(range(32)), list(range(32)))
        assert wait(handle) == TransferState.FAILED
        assert handle.error
        handle.release()
        again = start_peer("a-killed", "float32", seed=12)
        try:
            reader.transport.connect(again.name, again.metadata, again.num_blocks)
            handle = reader.transport.start_read(again.name, [5, 6], [5, 6])
            assert wait(handle) == TransferState.SUCCESS, handle.error
            handle.release()
            assert torch.equal(as_bytes(reader.cache[3][5:7]), as_bytes(again.cache[3][5:7]))
        finally:
            stop_peer(again)
    finally:
        reader.transport.close()
        reader.transport.close()  # safe twice


LATE = list(range(8, 40))  # the blocks of the READs below


@pytest.fixture
def stopped_peer(monkeypatch) -> Iterator[tuple[Peer, Reader]]:
    """A peer and a reader over UCX's TCP (a READ needs the peer's answer there, unlike CMA
    on one host), the peer stopped (SIGSTOP) after a first READ connected them: a READ
    posted now stays in flight until the peer is continued (SIGCONT)."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    peer = start_peer("a-stopped", "float32", seed=13)
    reader = start_reader("b-stopped", "float32")
    try:
        reader.transport.connect(peer.name, peer.metadata, peer.num_blocks)
        warm = reader.transport.start_read(peer.name, [0], [0])
        assert wait(warm) == TransferState.SUCCESS, warm.error
        warm.release()
        os.kill(peer.pid, signal.SIGSTOP)
        yield peer, reader
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        reader.transport.close()
        stop_peer(peer)


def landed(peer: Peer, reader: Reader) -> bool:
    """Every layer of LATE in the reader's cache is the peer's."""
    return all(
        torch.equal(as_bytes(mine[LATE]), as_bytes(theirs[LATE]))
        for mine, theirs in zip(reader.cache, peer.cache, strict=True)
    )


def test_a_read_released_in_flight_still_lands(stopped_peer) -> None:
    """What the workers' READs are built around (transfer.read_blocks): releasing a READ in
    flight frees NIXL's request without stopping it (UCX cannot cancel an RMA GET), so its
    bytes land afterwards, in whatever the blocks hold by then."""
    peer, reader = stopped_peer
    handle = reader.transport.start_read(peer.name, LATE, LATE)
    time.sleep(0.2)
    assert handle.poll() == TransferState.TRANSFERRING
    handle.release()  # no error: NIXL says it let go
    for layer in reader.cache:
        layer[LATE] = -7.0  # the blocks, freed, now another request's
    os.kill(peer.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not landed(peer, reader):
        assert time.monotonic() < deadline, "the released READ never landed"
        time.sleep(0.05)


def test_read_blocks_keeps_the_blocks_of_a_read_given_up_on_until_it_ends(stopped_peer) -> None:
    """`read_blocks` past its deadline raises at once, but what keeps the local blocks
    (a reservation's pin) is let go only once the READ has ended: every byte was in by
    then, none comes after."""
    peer, reader = stopped_peer
    let_go: list[bool] = []  # whether the bytes had landed when the blocks were let go

    @contextlib.asynccontextmanager
    async def keep() -> AsyncIterator[None]:
        yield
        let_go.append(landed(peer, reader))

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.3
        with pytest.raises(TransferError, match="deadline"):
            await read_blocks(reader.transport, peer.name, LATE, LATE, deadline, keep=keep())
        await asyncio.sleep(0.5)
        assert let_go == []  # the READ is still in flight: the blocks stay kept
        os.kill(peer.pid, signal.SIGCONT)
        give_up = loop.time() + 10
        while not let_go:
            assert loop.time() < give_up, "the blocks were never let go"
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert let_go == [True]
