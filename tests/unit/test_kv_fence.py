"""Epoch fencing on a decode worker's KV subject (shared/kvtransfer/fence.py), through the
link's receivers over the fake one-sided transport: an offer replayed from an older process
of its agent, one meant for this worker's previous process, and a message from another
process in the middle of a transfer are refused by name before anything moves; offers of
the right processes, or of senders that say no epoch, go through."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from shared.kvtransfer.fake_transport import FakeTransport
from shared.kvtransfer.fence import Fence, StaleEpoch
from shared.kvtransfer.link import KVLink, KVReceivers
from shared.kvtransfer.transfer import TransferState
from shared.protocol import KVDone, KVReady, Outcome
from tests.unit.test_fake_transport import LAYOUT, Reservation, mesh  # noqa: F401 (a fixture)

OLD, NEW, MINE = 1000, 2000, 5000  # the prefill agent's two processes; this decode process's


def offer(prefill: FakeTransport, epoch: int, to_epoch: int = MINE) -> KVReady:
    return KVReady(
        "r", "fake", "prefill-0", prefill.metadata(), prefill.num_blocks,
        [LAYOUT.num_layers, *LAYOUT.block_shape], LAYOUT.dtype,
        1, [3, 7, 8], [None] * 3, 9, time.time() + 10, epoch=epoch, to_epoch=to_epoch,
    )  # fmt: skip


def receivers(decode: FakeTransport) -> tuple[KVReceivers, Reservation]:
    reservation = Reservation()
    bus = SimpleNamespace(max_payload=1 << 20)
    link = KVLink(bus, "decode-0", LAYOUT, 4, 1024, reservation, None, decode, MINE)  # type: ignore[arg-type]
    return KVReceivers(link, reservation), reservation


def test_an_old_offer_replayed_after_its_agent_restarted_is_refused(mesh):  # noqa: F811
    _, prefill, decode = mesh
    kv, reservation = receivers(decode)
    asyncio.run(kv.on_ready(offer(prefill, NEW), {}))
    assert reservation.request.receiver.poll() == TransferState.SUCCESS
    before = [layer.clone() for layer in decode.layers]
    reservation.request.receiver = None  # the reservation awaits KV again
    with pytest.raises(StaleEpoch, match=r"stale offer .*epoch 1000 was replaced by epoch 2000"):
        asyncio.run(kv.on_ready(offer(prefill, OLD), {}))
    assert reservation.request.receiver is None  # refused before any receiver or READ
    assert all(torch.equal(a, b) for a, b in zip(before, decode.layers, strict=True))


def test_an_offer_for_this_workers_previous_process_is_refused(mesh):  # noqa: F811
    _, prefill, decode = mesh
    kv, reservation = receivers(decode)
    with pytest.raises(StaleEpoch, match=r"for process epoch 4000 .* this process is epoch 5000"):
        asyncio.run(kv.on_ready(offer(prefill, NEW, to_epoch=4000), {}))
    assert reservation.request.receiver is None


def test_a_message_from_another_process_mid_transfer_is_refused(mesh):  # noqa: F811
    _, prefill, decode = mesh
    kv, reservation = receivers(decode)
    asyncio.run(kv.on_ready(offer(prefill, NEW), {}))
    failed = KVDone("r", 0, 9, Outcome.FAILED, "gone", epoch=OLD, to_epoch=MINE)
    with pytest.raises(StaleEpoch, match="from process epoch 1000, the transfer from epoch 2000"):
        asyncio.run(kv.on_done(failed, {}))
    assert reservation.request.receiver.poll() == TransferState.SUCCESS


def test_unsaid_epochs_are_never_refused():
    fence = Fence(MINE)
    ready = KVReady("r", "fake", "a", b"", 1, [1, 1, 1, 1, 1], "float32", 0, [0], [None], 1, 1.0)
    fence.check(dataclasses.replace(ready, epoch=NEW), None)
    fence.check(ready, None)  # an old sender: no epoch, no check
    fence.check(dataclasses.replace(ready, epoch=NEW, to_epoch=0), NEW)
    assert Fence(0).newest == {}
    Fence(0).check(dataclasses.replace(ready, to_epoch=123), None)  # this process says none
