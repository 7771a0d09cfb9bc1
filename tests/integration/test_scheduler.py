"""The scheduler over a real nats-server, with fake workers written on `Bus`: placement by
prefix overlap, decode-only for short prompts, reservation fallback, refusals, waiting for
room (heartbeat wake-ups, queue timeout, Cancel, arrival order), worker loss, status; and
the scheduler's modules never import torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

from services.scheduler.config import SchedulerConfig
from services.scheduler.placement import RELEASED
from services.scheduler.service import SchedulerService
from shared.bus import Bus, Headers
from shared.engine.block_hash import hash_full_blocks
from shared.engine.sampling_params import SamplingParams
from shared.protocol import (
    Cancel,
    DecodeTask,
    Heartbeat,
    KVEvents,
    MeshStatus,
    Outcome,
    PrefillTask,
    Reservation,
    Reserve,
    StatusQuery,
    SubmitAck,
    SubmitRequest,
    TaskAck,
    WorkerLost,
)
from shared.subjects import Subjects

PROMPT = list(range(100, 170))  # 70 tokens: 4 full blocks of 16
HASHES = hash_full_blocks(PROMPT, 16, "m")  # "m": the model the fake workers report


ERRORS = {
    Outcome.BUSY: "no room: 3 free KV blocks",
    Outcome.UNAVAILABLE: "draining",
    Outcome.INVALID: "invalid grammar: bad rule",
    Outcome.FAILED: "engine step failed: RuntimeError",
}


@dataclass
class FakeWorker:
    worker_id: str
    role: str
    cached: list[int] = field(default_factory=list)
    free_blocks: int = 100
    reserve: Outcome = Outcome.OK  # its answer to Reserve
    task: Outcome = Outcome.OK  # its answer to PrefillTask / DecodeTask
    # BUSY to this many Reserves / tasks first; its heartbeats count them as waiting
    # requests, so each BUSY answer is followed by a heartbeat that shows less load.
    busy_answers: int = 0
    room_per_beat: int | None = None  # Reserves / tasks it takes between heartbeats; None: any
    num_cached_blocks: int = 0
    answer_delay: float = 0.0
    received: list[object] = field(default_factory=list)
    beating: bool = True
    room: int | None = None

    async def start(self, bus: Bus, subjects: Subjects) -> None:
        self.bus, self.subjects = bus, subjects
        await bus.serve(subjects.reserve(self.worker_id), Reserve, self._reserve, self._bad)
        await bus.serve(subjects.prefill(self.worker_id), PrefillTask, self._task, self._bad)
        await bus.serve(subjects.decode(self.worker_id), DecodeTask, self._task, self._bad)
        await self.beat()
        await bus.publish(subjects.kv_events, KVEvents(self.worker_id, 0, stored=self.cached))
        self._beats = asyncio.create_task(self._beat_forever())

    async def beat(self) -> None:
        self.room = self.room_per_beat
        heartbeat = Heartbeat(
            self.worker_id, self.role, "m", 0, self.busy_answers, self.free_blocks, 200, 16
        )
        await self.bus.publish(self.subjects.heartbeat, heartbeat)

    async def _beat_forever(self) -> None:
        while self.beating:
            await asyncio.sleep(0.2)
            await self.beat()

    def _answer(self, message: object, outcome: Outcome) -> Outcome:
        self.received.append(message)
        if self.busy_answers > 0 or self.room == 0:
            self.busy_answers = max(0, self.busy_answers - 1)
            return Outcome.BUSY
        if self.room is not None:
            self.room -= 1
        return outcome

    async def _reserve(self, message: Reserve, headers: Headers) -> Reservation:
        outcome = self._answer(message, self.reserve)
        error = ERRORS.get(outcome, "")
        return Reservation(message.request_id, outcome, 5, self.num_cached_blocks, error)

    async def _task(self, message: PrefillTask | DecodeTask, headers: Headers) -> TaskAck:
        outcome = self._answer(message, self.task)
        await asyncio.sleep(self.answer_delay)
        return TaskAck(message.request.request_id, outcome, ERRORS.get(outcome, ""))

    def _bad(self, reason: str) -> TaskAck:
        return TaskAck("", Outcome.INVALID, reason)


def submit(request_id: str, prompt: list[int] = PROMPT) -> SubmitRequest:
    return SubmitRequest(request_id, "gw1", prompt, SamplingParams(), time.time() + 30)


@asynccontextmanager
async def mesh(
    url: str, namespace: str, workers: list[FakeWorker], **config: object
) -> AsyncIterator[Bus]:
    """A scheduler and the fake workers on `namespace`; yields a client bus once the
    scheduler has heard from every worker."""
    subjects = Subjects(namespace)
    settings = dict(namespace=namespace, heartbeat_timeout=1.0, sweep_interval=0.1) | config
    sched_bus = await Bus.connect(url, "scheduler")
    service = SchedulerService(SchedulerConfig(nats_url=url, **settings), sched_bus)
    await service.start()
    worker_bus = await Bus.connect(url, "workers")
    client = await Bus.connect(url, "client")
    for worker in workers:
        await worker.start(worker_bus, subjects)
    deadline = time.monotonic() + 5
    while len((await status(client, subjects)).workers) < len(workers):
        assert time.monotonic() < deadline, "scheduler never saw all workers"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # KV events published after the first heartbeat
    try:
        yield client
    finally:
        for worker in workers:
            worker.beating = False
            worker._beats.cancel()
            with suppress(asyncio.CancelledError):
                await worker._beats
        await service.stop()
        for bus in (client, worker_bus, sched_bus):
            await bus.close()


async def status(client: Bus, subjects: Subjects) -> MeshStatus:
    return await client.request(subjects.status, StatusQuery(), MeshStatus, timeout=2)


async def place(client: Bus, namespace: str, request: SubmitRequest) -> SubmitAck:
    return await client.request(Subjects(namespace).submit, request, SubmitAck, timeout=5)


async def record_cancels(client: Bus, namespace: str) -> list[Cancel]:
    cancels: list[Cancel] = []

    async def on_cancel(message: Cancel, headers: Headers) -> None:
        cancels.append(message)

    await client.subscribe(Subjects(namespace).cancel, Cancel, on_cancel)
    await client.nc.flush()
    return cancels


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_prefill_by_overlap_short_prompt_decode_only_and_status(nats_server):
    async def scenario() -> None:
        p1 = FakeWorker("p1", "prefill", cached=HASHES[:1])
        p2 = FakeWorker("p2", "prefill", cached=HASHES[:3])
        d1 = FakeWorker("d1", "decode", num_cached_blocks=1)
        async with mesh(nats_server.url, "s1", [p1, p2, d1]) as client:
            ack = await place(client, "s1", submit("r1"))
            assert ack == SubmitAck("r1", Outcome.OK, prefill_worker="p2", decode_worker="d1")
            assert [type(m) for m in d1.received] == [Reserve]
            (task,) = p2.received
            assert isinstance(task, PrefillTask)
            assert (task.decode_worker, task.skip_blocks) == ("d1", 1)
            assert task.request.prompt_token_ids == PROMPT

            short = await place(client, "s1", submit("r2", PROMPT[:10]))
            assert short == SubmitAck("r2", Outcome.OK, decode_worker="d1")
            assert isinstance(d1.received[-1], DecodeTask)

            mesh_status = await status(client, Subjects("s1"))
            assigned = {w.heartbeat.worker_id: w.assigned for w in mesh_status.workers}
            assert assigned == {"d1": ["r1", "r2"], "p1": [], "p2": ["r1"]}
            assert (mesh_status.admitted, mesh_status.rejected) == (2, 0)

    asyncio.run(scenario())


def test_refused_reservation_falls_back_and_failed_prefill_frees_it_and_waits(nats_server):
    async def scenario() -> None:
        d1 = FakeWorker("d1", "decode", free_blocks=150, reserve=Outcome.UNAVAILABLE)
        d2 = FakeWorker("d2", "decode", free_blocks=50)
        p1 = FakeWorker("p1", "prefill")
        async with mesh(nats_server.url, "s2", [d1, d2, p1], queue_timeout=0.5) as client:
            ack = await place(client, "s2", submit("r1"))
            assert (ack.outcome, ack.decode_worker, ack.prefill_worker) == (Outcome.OK, "d2", "p1")
            assert len(d1.received) == 1  # asked first (more free blocks), refused

            cancels = await record_cancels(client, "s2")
            p1.task = Outcome.FAILED
            refused = await place(client, "s2", submit("r2"))
            assert refused.outcome == Outcome.UNAVAILABLE and refused.retry_after > 0
            assert "no worker had room" in refused.error and "p1 failed" in refused.error
            prefills = [m for m in p1.received if m.request.request_id == "r2"]
            assert len(prefills) >= 2  # tried again while it waited
            await asyncio.sleep(0.2)
            # Every try freed its reservation on d2, without cancelling the request itself.
            assert {(c.request_id, c.reason) for c in cancels} == {("r2", RELEASED)}
            assert len(cancels) == len(prefills)

    asyncio.run(scenario())


def test_no_workers_waits_then_refuses_and_a_full_queue_refuses_at_once(nats_server):
    async def scenario() -> None:
        async with mesh(nats_server.url, "s3", [], queue_timeout=0.3) as client:
            ack = await place(client, "s3", submit("r1"))
            assert ack.outcome == Outcome.UNAVAILABLE and ack.retry_after == 1.0
            assert ack.error == "no worker had room for 0 s: no worker for role decode"

        full = FakeWorker("d1", "both", busy_answers=10**6)
        async with mesh(nats_server.url, "s4", [full], max_queue=1) as client:
            waiting = asyncio.create_task(place(client, "s4", submit("r1")))
            await until(lambda: len(full.received) > 0)
            started = time.monotonic()
            refused = await place(client, "s4", submit("r2"))
            assert time.monotonic() - started < 0.5
            assert refused.outcome == Outcome.BUSY and refused.retry_after > 0
            assert "busy" in refused.error and not waiting.done()
            await client.publish(Subjects("s4").cancel, Cancel("r1", "gateway"))
            assert (await waiting).outcome == Outcome.UNAVAILABLE

    asyncio.run(scenario())


def test_silent_worker_is_lost_with_its_requests(nats_server):
    async def scenario() -> None:
        d1 = FakeWorker("d1", "both")
        d2 = FakeWorker("d2", "both", free_blocks=2)  # too small for the prompt
        async with mesh(nats_server.url, "s5", [d1, d2]) as client:
            for request_id in ("r1", "r2", "r3"):
                assert (await place(client, "s5", submit(request_id))).decode_worker == "d1"
            await client.publish(Subjects("s5").cancel, Cancel("r2"))
            lost: list[WorkerLost] = []
            arrived = asyncio.Event()

            async def on_event(message: WorkerLost, headers: Headers) -> None:
                lost.append(message)
                arrived.set()

            await client.subscribe(Subjects("s5").events, WorkerLost, on_event)
            await client.nc.flush()
            d1.beating = False
            await asyncio.wait_for(arrived.wait(), 5)
            assert lost == [WorkerLost("d1", ["r1", "r3"])]
            workers = (await status(client, Subjects("s5"))).workers
            assert [w.heartbeat.worker_id for w in workers] == ["d2"]

    asyncio.run(scenario())


def test_scheduler_never_imports_torch():
    code = (
        "import sys, argparse\n"
        "import services.scheduler.service, services.scheduler.cli as c\n"
        "p = argparse.ArgumentParser(); c.add_parser(p.add_subparsers())\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


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
