"""The one-sided KV path between real workers (in-process, real nats-server) over the `fake`
transport, which has the `nixl` transport's shape: the decode worker READs the prefill
worker's blocks into its reservation; forged offers are refused before any byte moves; a
READ that fails or whose source is gone fails the request, so its gateway migrates it,
and leaves no block behind on either side. A READ given up on while in flight (a Cancel,
its deadline) ends the request at once, but its blocks stay held until it has ended: its
bytes still land (NIXL's, and the fake's, release does not stop a READ), and landing in
blocks another request computes into made migrated streams differ (issue 60)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.fake_transport import FakeFabric, FakeTransport, ReadFault
from shared.protocol import (
    Cancel,
    DecodeTask,
    KVReady,
    Outcome,
    Reservation,
    Reserve,
    TaskAck,
    WorkerLost,
)
from tests.integration.test_worker import (
    GREEDY,
    NUM_BLOCKS,
    PROMPT,
    SEEDED,
    Mesh,
    reference,
    run_mesh,
    until,
)


def fake_factory(fabric: FakeFabric):
    def make(name: str, layers, layout: KVLayout, wanted: str) -> FakeTransport:
        return FakeTransport(name, layers, layout, fabric)

    return make


def all_blocks_free(mesh: Mesh) -> bool:
    beats = [mesh.beats.get(w) for w in ("prefill", "decode")]
    return all(b is not None and b.free_blocks == b.total_blocks for b in beats)


def test_one_sided_transfer_streams_what_one_engine_would(nats_server, tiny_model_dir):
    """No KV chunk crosses NATS: the decode worker READs the blocks; the heartbeats name the
    transport per pair."""
    fabric = FakeFabric()

    async def scenario(mesh: Mesh) -> None:
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            reservation = await mesh.split(mesh.request(name, params))
            assert reservation.transports == ["fake", "nats"]
            assert await mesh.tokens(name) == reference(tiny_model_dir, PROMPT, params), name
        assert mesh.blocks_sent == {}  # counted from KV chunks on the decode's subject
        mesh.beats.clear()
        await until(lambda: "prefill" in mesh.beats and "decode" in mesh.beats)
        (peer,) = mesh.beats["prefill"].kv_peers
        assert (peer.worker_id, peer.transport, peer.blocks, peer.transfers) == (
            "decode",
            "fake",
            5,
            2,
        )  # 4 blocks, then 1: the second prompt's 3 full blocks are in decode's prefix cache
        assert mesh.beats["decode"].kv_blocks_received == 5
        assert mesh.beats["decode"].kv_transports == ["fake", "nats"]

    run_mesh(nats_server.url, tiny_model_dir, scenario, transport_factory=fake_factory(fabric))


def test_forged_offers_are_refused_before_any_byte_moves(nats_server, tiny_model_dir):
    fabric = FakeFabric()

    async def scenario(mesh: Mesh) -> None:
        reply = await mesh.bus.request(
            mesh.subjects.reserve("decode"), Reserve(mesh.request("r", GREEDY)), Reservation, 5
        )
        assert reply.ok and reply.num_blocks == 4
        decode_cache = fabric.transports["decode"].layers
        before = [layer.clone() for layer in decode_cache]
        prefill = fabric.transports["prefill"]
        layout = [prefill.layout.num_layers, *prefill.layout.block_shape]
        dtype = prefill.layout.dtype  # the workers' (--dtype auto: bf16 on some CPUs)
        good = KVReady(
            "r", "fake", "prefill", b"prefill", NUM_BLOCKS, layout, dtype,
            0, [1, 2, 3, 4], [None] * 4, 5, time.time() + 10,
        )  # fmt: skip
        forged = {
            "transport": {"transport": "nixl"},
            "layout": {"layout": [layout[0] + 1, *layout[1:]]},
            "dtype": {"dtype": "float16" if dtype != "float16" else "float32"},
            "block_ids": {"block_ids": [1, 2, 3]},
            "outside": {"block_ids": [1, 2, 3, NUM_BLOCKS]},
            "hash": {"block_hashes": [12345, None, None, None]},
            "agent_metadata": {"agent_metadata": b"someone else"},
        }
        subject = mesh.subjects.kv("decode")
        for field, change in forged.items():
            ack = await mesh.bus.request(subject, replace(good, **change), TaskAck, 5)
            assert ack.outcome in (Outcome.INVALID, Outcome.UNAVAILABLE), (field, ack)
            assert all(a.equal(b) for a, b in zip(decode_cache, before, strict=True)), field
            reply = await mesh.bus.request(
                mesh.subjects.reserve("decode"), Reserve(mesh.request("r", GREEDY)), Reservation, 5
            )  # the refusal dropped the reservation: take it again for the next forgery
            assert reply.ok, (field, reply)
        await mesh.bus.publish(mesh.subjects.cancel, Cancel("r", "test over"))

    run_mesh(nats_server.url, tiny_model_dir, scenario, transport_factory=fake_factory(fabric))


def test_a_failed_read_fails_the_request_and_frees_every_block(nats_server, tiny_model_dir):
    """A READ that fails (or whose source died) is FAILED on both sides: the gateway gets
    an error chunk from the prefill worker (and migrates), and both caches are whole."""
    fabric = FakeFabric()

    async def scenario(mesh: Mesh) -> None:
        fabric.set_fault("prefill", ReadFault.FAIL)
        await mesh.split(mesh.request("doomed", GREEDY))
        await until(lambda: any(c.error for c in mesh.chunks.get("doomed", [])))
        errors = [c.error for c in mesh.chunks["doomed"] if c.error]
        assert "injected failure" in errors[0]
        mesh.beats.clear()
        await until(lambda: all_blocks_free(mesh), timeout=5)
        assert all(not mesh.beats[w].num_requests for w in ("prefill", "decode"))
        fabric.set_fault("prefill", ReadFault.NONE)
        await mesh.split(mesh.request("fine", GREEDY))  # both workers are unharmed
        assert await mesh.tokens("fine") == reference(tiny_model_dir, PROMPT, GREEDY)

    run_mesh(nats_server.url, tiny_model_dir, scenario, transport_factory=fake_factory(fabric))


def test_a_stalled_read_ends_at_its_deadline(nats_server, tiny_model_dir):
    fabric = FakeFabric()

    async def scenario(mesh: Mesh) -> None:
        fabric.set_fault("prefill", ReadFault.STALL)
        started = time.monotonic()
        await mesh.split(mesh.request("stuck", GREEDY))
        await until(lambda: any(c.error for c in mesh.chunks.get("stuck", [])), timeout=10)
        assert time.monotonic() - started < 6  # transfer_timeout 4 s: the READ gets half
        await until(lambda: not mesh.workers[1].table.get("stuck"))
        await asyncio.sleep(0.5)
        mesh.beats.clear()
        await until(lambda: "decode" in mesh.beats and "prefill" in mesh.beats)
        assert mesh.beats["prefill"].free_blocks == NUM_BLOCKS
        assert mesh.beats["decode"].free_blocks == NUM_BLOCKS - 4  # the READ may still land
        fabric.set_fault("prefill", ReadFault.NONE)  # it ends: now they are free
        mesh.beats.clear()
        await until(lambda: all_blocks_free(mesh), timeout=5)

    run_mesh(
        nats_server.url,
        tiny_model_dir,
        scenario,
        transport_factory=fake_factory(fabric),
        transfer_timeout=4.0,
    )


@pytest.mark.parametrize("lost, survivor", [("prefill", "decode"), ("decode", "prefill")])
def test_a_transfer_whose_peer_is_lost_frees_the_survivors_blocks_at_once(
    nats_server, tiny_model_dir, lost, survivor
):
    """The READ stalls (its peer stopped answering); the scheduler's `WorkerLost` for one
    side ends the request on the other within a beat, not at a deadline: a decode worker
    gives up on the READ, a prefill worker drops the blocks it held for the lost decode
    worker. Its gateway migrates the request (no error chunk from the survivor). The
    decode worker's blocks come back once the READ has ended: a lost prefill worker may only
    be frozen, and its READ land later; once it is dead (NIXL fails the READ), at once."""
    fabric = FakeFabric()

    async def scenario(mesh: Mesh) -> None:
        fabric.set_fault("prefill", ReadFault.STALL)
        await mesh.split(mesh.request("stranded", GREEDY))
        await until(lambda: "stranded" in mesh.chunks)  # first token out, the READ posted
        await asyncio.sleep(0.3)
        lost_at = time.monotonic()
        await mesh.bus.publish(mesh.subjects.events, WorkerLost(lost, ["stranded"]))
        mesh.beats.clear()
        await until(lambda: survivor in mesh.beats and not mesh.beats[survivor].num_requests)
        if lost == "prefill":
            await asyncio.sleep(0.3)
            mesh.beats.clear()
            await until(lambda: survivor in mesh.beats)
            assert mesh.beats[survivor].free_blocks == NUM_BLOCKS - 4  # the READ may land
            fabric.remove("prefill")  # now it died: the READ fails, nothing more can land
        await until(lambda: mesh.beats[survivor].free_blocks == NUM_BLOCKS, timeout=2)
        assert time.monotonic() - lost_at < 3  # the deadlines are 15 s and 30 s away
        assert not any(c.error for c in mesh.chunks["stranded"])
        await mesh.bus.publish(mesh.subjects.cancel, Cancel("stranded", "migrated"))

    run_mesh(
        nats_server.url,
        tiny_model_dir,
        scenario,
        transport_factory=fake_factory(fabric),
        transfer_timeout=30.0,
    )


VICTIM = [(11 * i) % 250 + 3 for i in range(50)]  # another prompt of PROMPT's 4 blocks


def test_a_read_given_up_on_never_lands_in_another_requests_blocks(nats_server, tiny_model_dir):
    """The netem chaos case's wrong text (issue 60): a READ over a slow link is given up on
    (the gateway migrates; its Cancel ends the reservation), the migrated attempt or
    another request computes on the decode worker, and the abandoned READ's bytes land
    afterwards. Before, the reservation's blocks were freed at the Cancel, the next request
    took them (the pool hands out the last freed first) and its stream went wrong from the
    landing on; now they stay held until the READ has ended."""
    fabric = FakeFabric()
    long_greedy = replace(GREEDY, max_tokens=300)

    async def scenario(mesh: Mesh) -> None:
        fabric.set_fault("prefill", ReadFault.STALL)
        await mesh.split(mesh.request("stuck", GREEDY))
        await until(lambda: "stuck" in mesh.chunks)  # first token out, the READ posted
        await asyncio.sleep(0.3)
        await mesh.bus.publish(mesh.subjects.cancel, Cancel("stuck", "migrated"))
        await until(lambda: not mesh.workers[1].table.get("stuck"))
        task = DecodeTask(mesh.request("victim", long_greedy, VICTIM))
        ack = await mesh.bus.request(mesh.subjects.decode("decode"), task, TaskAck, 5)
        assert ack.ok, ack.error
        await until(lambda: "victim" in mesh.chunks)  # its prompt's KV is computed
        fabric.set_fault("prefill", ReadFault.NONE)  # the abandoned READ lands now
        assert await mesh.tokens("victim") == reference(tiny_model_dir, VICTIM, long_greedy)
        mesh.beats.clear()
        await until(lambda: all_blocks_free(mesh), timeout=5)

    run_mesh(nats_server.url, tiny_model_dir, scenario, transport_factory=fake_factory(fabric))
