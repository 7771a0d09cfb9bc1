"""`read_blocks` (shared/kvtransfer/transfer.py) over the `fake` transport, whose release of
a READ in flight does not stop it, as NIXL's does not (tests/integration/test_nixl_transport.py
shows NIXL doing so): a READ given up on (its deadline, a cancel) lets its caller go at once,
but what keeps its local blocks (`keep`) is let go only once the READ has ended, so no byte
lands in blocks another request owns by then (issue 60: migrated streams that differed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch

from services.worker.peer_reads import TakenBlocks
from shared.engine.kv_tier.peer import PeerTake
from shared.kvtransfer.fake_transport import FakeTransport, ReadFault
from shared.kvtransfer.transfer import TransferError, TransferState, read_blocks
from tests.unit.fake_kv_pair import LOCAL, REMOTE, pair


def landed(decode: FakeTransport, prefill: FakeTransport) -> bool:
    return all(
        torch.equal(mine[LOCAL], theirs[REMOTE])
        for mine, theirs in zip(decode.layers, prefill.layers, strict=True)
    )


class Keep:
    """A `keep` that records whether the READ's bytes were in when it was let go."""

    def __init__(self, decode: FakeTransport, prefill: FakeTransport) -> None:
        self.decode, self.prefill = decode, prefill
        self.entered = False
        self.let_go: list[bool] = []

    @contextlib.asynccontextmanager
    async def blocks(self) -> AsyncIterator[None]:
        self.entered = True
        yield
        self.let_go.append(landed(self.decode, self.prefill))


async def settle(keep: Keep) -> None:
    for _ in range(200):  # the waiter polls every 10 ms
        if keep.let_go:
            return
        await asyncio.sleep(0.01)


def test_a_read_that_ends_lets_its_blocks_go_at_once() -> None:
    async def run() -> Keep:
        _, prefill, decode = pair()
        keep = Keep(decode, prefill)
        deadline = asyncio.get_running_loop().time() + 5
        await read_blocks(decode, "prefill-0", REMOTE, LOCAL, deadline, keep=keep.blocks())
        return keep

    keep = asyncio.run(run())
    assert keep.entered and keep.let_go == [True]


def test_a_read_past_its_deadline_raises_at_once_and_keeps_its_blocks_until_it_ends() -> None:
    async def run() -> Keep:
        fabric, prefill, decode = pair()
        fabric.set_fault("prefill-0", ReadFault.STALL)
        keep = Keep(decode, prefill)
        deadline = asyncio.get_running_loop().time() + 0.05
        with pytest.raises(TransferError, match="deadline"):
            await read_blocks(decode, "prefill-0", REMOTE, LOCAL, deadline, keep=keep.blocks())
        await asyncio.sleep(0.1)
        assert keep.let_go == []  # in flight: the blocks stay kept
        fabric.set_fault("prefill-0", ReadFault.NONE)  # the READ goes on and lands
        await settle(keep)
        return keep

    assert asyncio.run(run()).let_go == [True]  # let go only once every byte was in


def test_a_cancelled_read_is_waited_out_beside_its_caller() -> None:
    async def run() -> Keep:
        fabric, prefill, decode = pair()
        fabric.set_fault("prefill-0", ReadFault.STALL)
        keep = Keep(decode, prefill)
        deadline = asyncio.get_running_loop().time() + 30
        read = asyncio.create_task(
            read_blocks(decode, "prefill-0", REMOTE, LOCAL, deadline, keep=keep.blocks())
        )
        await asyncio.sleep(0.05)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read  # the caller goes at once
        assert keep.let_go == []
        fabric.remove("prefill-0")  # its source died: the READ fails, nothing more comes
        await settle(keep)
        return keep

    assert asyncio.run(run()).let_go == [False]


def test_the_fake_like_nixl_lands_a_read_released_in_flight_when_its_stall_clears() -> None:
    fabric, prefill, decode = pair()
    fabric.set_fault("prefill-0", ReadFault.STALL)
    handle = decode.start_read("prefill-0", REMOTE, LOCAL)
    assert handle.poll() == TransferState.TRANSFERRING
    handle.release()
    assert not landed(decode, prefill)
    fabric.set_fault("prefill-0", ReadFault.NONE)
    assert landed(decode, prefill)


class Pool:
    """A `PeerBlocks` that records what is given back to it, and whether the READ had
    landed by then."""

    def __init__(self, decode: FakeTransport, prefill: FakeTransport) -> None:
        self.decode, self.prefill = decode, prefill
        self.adopted: list[tuple[int, bool]] = []

    def adopt(self, take: PeerTake, num_read: int) -> None:
        self.adopted.append((num_read, landed(self.decode, self.prefill)))


def test_blocks_taken_for_a_peer_read_go_back_once_its_read_given_up_on_has_ended() -> None:
    """services/worker/peer_reads.py: a read of prefix blocks from a peer that gives up on
    its READ computes the prompt at once, but its taken blocks go back to the pool (and no
    other holder is asked into them) only once that READ has ended."""

    async def run() -> Pool:
        fabric, prefill, decode = pair()
        fabric.set_fault("prefill-0", ReadFault.STALL)
        pool = Pool(decode, prefill)
        taken = TakenBlocks(pool, PeerTake(0, LOCAL, [11, 12]))  # type: ignore[arg-type]
        deadline = asyncio.get_running_loop().time() + 0.05
        with pytest.raises(TransferError):
            await read_blocks(decode, "prefill-0", REMOTE, LOCAL, deadline, keep=taken.reading())
        assert taken.in_flight == 1  # the next holder is not asked into these blocks
        taken.over(0)
        assert pool.adopted == []
        fabric.set_fault("prefill-0", ReadFault.NONE)
        for _ in range(200):
            if pool.adopted:
                break
            await asyncio.sleep(0.01)
        return pool

    assert asyncio.run(run()).adopted == [(0, True)]  # given back, none cached, after landing
