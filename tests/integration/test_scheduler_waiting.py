"""The scheduler over a real nats-server, with fake workers (tests/integration/
scheduler_harness.py): cancels during placement, lost and busy workers, requests a worker
finds invalid, waiting for room (heartbeat wake-ups, queue timeout, arrival order) and
failed workers passed over."""

from __future__ import annotations

import asyncio
import time

from shared.protocol import (
    Cancel,
    Outcome,
    PrefillTask,
    Reserve,
    SubmitAck,
)
from shared.subjects import Subjects
from tests.integration.scheduler_harness import (
    HASHES,
    FakeWorker,
    mesh,
    place,
    record_cancels,
    status,
    submit,
    until,
)


def test_a_cancel_during_placement_stops_it(nats_server):
    """The gateway gave up on an attempt (and migrated it) while its PrefillTask waited on a
    silent worker: the scheduler must not go on to place it on the next prefill worker."""

    async def scenario() -> None:
        slow = FakeWorker("p1", "prefill", cached=HASHES[:3], answer_delay=1.5)
        spare = FakeWorker("p2", "prefill")
        d1 = FakeWorker("d1", "decode")
        async with mesh(nats_server.url, "s6", [slow, spare, d1], reserve_timeout=0.5) as client:
            placing = asyncio.create_task(place(client, "s6", submit("r6")))
            await asyncio.sleep(0.2)  # the PrefillTask is waiting on p1
            await client.publish(Subjects("s6").cancel, Cancel("r6", "gateway"))
            ack = await placing
            assert ack.outcome == Outcome.UNAVAILABLE and "cancelled" in ack.error
            assert [type(m) for m in spare.received] == []

    asyncio.run(scenario())


def test_a_placement_waiting_on_a_lost_worker_moves_on_at_once(nats_server):
    """A PrefillTask sits with a worker that died before answering (NATS delivered it, so
    no NoResponders): when the sweeper expires that worker, the placement goes on to the
    next prefill worker instead of waiting out `reserve_timeout`."""

    async def scenario() -> None:
        dead = FakeWorker("p1", "prefill", cached=HASHES[:3], answer_delay=60)
        spare = FakeWorker("p2", "prefill")
        d1 = FakeWorker("d1", "decode")
        config = dict(reserve_timeout=30.0, heartbeat_timeout=0.5)
        async with mesh(nats_server.url, "s7", [dead, spare, d1], **config) as client:
            placing = asyncio.create_task(place(client, "s7", submit("r7")))
            while not dead.received:  # the task reached p1, which now "dies"
                await asyncio.sleep(0.01)
            dead.beating = False
            started = time.monotonic()
            ack = await placing
            waited = time.monotonic() - started
            assert ack.accepted and ack.prefill_worker == "p2", ack
            assert waited < 5, f"waited {waited:.1f}s for a lost worker"
            assert [type(m) for m in spare.received] == [PrefillTask]

    asyncio.run(scenario())


def test_a_placed_prompt_counts_as_cached_on_its_workers_at_once(nats_server):
    """The sibling choices of an `n` > 1 request come right behind choice 0, before any KV
    event: they must still go to the workers that hold (or are computing) its blocks."""

    async def scenario() -> None:
        p1, p2 = FakeWorker("p1", "prefill"), FakeWorker("p2", "prefill")
        d1, d2 = FakeWorker("d1", "decode"), FakeWorker("d2", "decode")
        async with mesh(nats_server.url, "s8", [p1, p2, d1, d2]) as client:
            first = await place(client, "s8", submit("c0"))
            sibling = await place(client, "s8", submit("c1"))
            other = await place(client, "s8", submit("x", prompt=list(range(300, 370))))
            assert first.accepted and sibling.accepted and other.accepted
            assert sibling.prefill_worker == first.prefill_worker
            # Without a shared prefix, load decides: the busy pair is avoided.
            assert other.prefill_worker != first.prefill_worker

    asyncio.run(scenario())


def test_a_request_a_worker_finds_invalid_is_refused_as_invalid_at_once(nats_server):
    """The engine's validation (a grammar xgrammar rejects, a prompt past the context) is
    the same on every worker: the scheduler stops at the first refusal, answers INVALID (the
    gateway answers 400 with the worker's message) and frees the reservation."""

    async def scenario() -> None:
        p1 = FakeWorker("p1", "prefill", cached=HASHES[:3], task=Outcome.INVALID)
        p2 = FakeWorker("p2", "prefill")
        d1 = FakeWorker("d1", "decode")
        async with mesh(nats_server.url, "s9", [p1, p2, d1]) as client:
            cancels = await record_cancels(client, "s9")
            ack = await place(client, "s9", submit("bad"))
            assert ack.outcome == Outcome.INVALID and ack.retry_after == 0
            assert ack.error == "invalid grammar: bad rule"
            assert p2.received == []
            await asyncio.sleep(0.2)
            assert [c.request_id for c in cancels] == ["bad"]

    asyncio.run(scenario())


def test_a_busy_decode_worker_gets_the_request_once_its_heartbeat_shows_room(nats_server):
    """d1 answers BUSY to two Reserves: the request waits (no 429) and is placed after the
    heartbeat that shows d1's load gone down; the sweeper's backoff is too slow to do it."""

    async def scenario() -> None:
        d1 = FakeWorker("d1", "decode", busy_answers=2)
        p1 = FakeWorker("p1", "prefill")
        async with mesh(nats_server.url, "s10", [d1, p1], sweep_interval=30.0) as client:
            started = time.monotonic()
            ack = await place(client, "s10", submit("r1"))
            assert ack == SubmitAck("r1", Outcome.OK, prefill_worker="p1", decode_worker="d1")
            assert [type(m) for m in d1.received] == [Reserve] * 3
            assert time.monotonic() - started < 3
            mesh_status = await status(client, Subjects("s10"))
            assert (mesh_status.queue_length, mesh_status.admitted) == (0, 1)

    asyncio.run(scenario())


def test_a_request_that_waits_past_queue_timeout_is_refused_unavailable(nats_server):
    async def scenario() -> None:
        d1 = FakeWorker("d1", "decode", busy_answers=10**6)
        p1 = FakeWorker("p1", "prefill")
        async with mesh(nats_server.url, "s11", [d1, p1], queue_timeout=0.6) as client:
            started = time.monotonic()
            ack = await place(client, "s11", submit("r1"))
            waited = time.monotonic() - started
            assert ack.outcome == Outcome.UNAVAILABLE and ack.retry_after == 1.0
            assert ack.error.startswith("no worker had room for 1 s: no decode worker took")
            assert "d1 busy: no room" in ack.error
            assert 0.6 <= waited < 3 and len(d1.received) >= 2
            mesh_status = await status(client, Subjects("s11"))
            assert (mesh_status.queue_length, mesh_status.rejected) == (0, 1)

    asyncio.run(scenario())


def test_a_cancel_ends_a_waiting_placement_at_once(nats_server):
    async def scenario() -> None:
        d1 = FakeWorker("d1", "both", room_per_beat=0)  # full, and its heartbeats say so
        config = dict(queue_timeout=30.0, sweep_interval=30.0)  # no backoff tick to end it
        async with mesh(nats_server.url, "s12", [d1], **config) as client:
            placing = asyncio.create_task(place(client, "s12", submit("r1")))
            await until(lambda: len(d1.received) > 0)
            started = time.monotonic()
            await client.publish(Subjects("s12").cancel, Cancel("r1", "gateway"))
            ack = await placing
            assert time.monotonic() - started < 1
            assert ack.outcome == Outcome.UNAVAILABLE and "cancelled" in ack.error
            assert (await status(client, Subjects("s12"))).queue_length == 0

    asyncio.run(scenario())


def test_waiting_requests_are_placed_in_arrival_order(nats_server):
    """d1 is full, then takes one Reserve per heartbeat: the four waiting requests get the
    room one by one, oldest first."""

    async def scenario() -> None:
        d1 = FakeWorker("d1", "decode", room_per_beat=0)
        p1 = FakeWorker("p1", "prefill")
        async with mesh(nats_server.url, "s13", [d1, p1]) as client:
            ids = ["r1", "r2", "r3", "r4"]
            placing = []
            for request_id in ids:
                placing.append(asyncio.create_task(place(client, "s13", submit(request_id))))
                await asyncio.sleep(0.05)
            assert (await status(client, Subjects("s13"))).queue_length == 4
            d1.room_per_beat = 1
            acks = await asyncio.gather(*placing)
            assert [a.outcome for a in acks] == [Outcome.OK] * 4
            assert [t.request.request_id for t in p1.received] == ids

    asyncio.run(scenario())


def test_a_failed_worker_is_passed_over_and_tried_again_later(nats_server):
    """FAILED (the worker's engine broke) moves on to the next worker, and is never a 400:
    with every prefill worker failing the request waits, and is placed once one recovers."""

    async def scenario() -> None:
        d1 = FakeWorker("d1", "decode", free_blocks=150, reserve=Outcome.FAILED)
        d2 = FakeWorker("d2", "decode")
        p1 = FakeWorker("p1", "prefill", cached=HASHES[:3], task=Outcome.FAILED)
        p2 = FakeWorker("p2", "prefill")
        async with mesh(nats_server.url, "s14", [d1, d2, p1, p2]) as client:
            ack = await place(client, "s14", submit("r1"))
            assert ack == SubmitAck("r1", Outcome.OK, prefill_worker="p2", decode_worker="d2")
            assert ([type(m) for m in d1.received], len(p1.received)) == ([Reserve], 1)

            p2.task = Outcome.FAILED
            placing = asyncio.create_task(place(client, "s14", submit("r2")))
            await until(lambda: len(p2.received) >= 3)  # r2 tried p2 twice: it waits
            assert not placing.done()
            p2.task = Outcome.OK
            ack = await placing
            assert (ack.outcome, ack.prefill_worker) == (Outcome.OK, "p2")

    asyncio.run(scenario())
