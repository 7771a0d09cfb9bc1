"""The scheduler over a real nats-server, with fake workers written on `Bus`: placement by
prefix overlap, decode-only for short prompts, reservation fallback, refusals, worker loss,
status; and the scheduler's modules never import torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

from services.scheduler.config import SchedulerConfig
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


@dataclass
class FakeWorker:
    worker_id: str
    role: str
    cached: list[int] = field(default_factory=list)
    free_blocks: int = 100
    reserve_ok: bool = True
    accept: bool = True
    invalid: bool = False  # refuse tasks as bad requests (the engine's ValueError)
    num_cached_blocks: int = 0
    answer_delay: float = 0.0
    received: list[object] = field(default_factory=list)
    beating: bool = True

    async def start(self, bus: Bus, subjects: Subjects) -> None:
        self.bus, self.subjects = bus, subjects
        await bus.serve(subjects.reserve(self.worker_id), Reserve, self._reserve, self._bad)
        await bus.serve(subjects.prefill(self.worker_id), PrefillTask, self._task, self._bad)
        await bus.serve(subjects.decode(self.worker_id), DecodeTask, self._task, self._bad)
        await self.beat()
        await bus.publish(subjects.kv_events, KVEvents(self.worker_id, 0, stored=self.cached))
        self._beats = asyncio.create_task(self._beat_forever())

    async def beat(self) -> None:
        heartbeat = Heartbeat(self.worker_id, self.role, "m", 0, 0, self.free_blocks, 200, 16)
        await self.bus.publish(self.subjects.heartbeat, heartbeat)

    async def _beat_forever(self) -> None:
        while self.beating:
            await asyncio.sleep(0.2)
            await self.beat()

    async def _reserve(self, message: Reserve, headers: Headers) -> Reservation:
        self.received.append(message)
        return Reservation(message.request_id, self.reserve_ok, 5, self.num_cached_blocks)

    async def _task(self, message: PrefillTask | DecodeTask, headers: Headers) -> TaskAck:
        self.received.append(message)
        await asyncio.sleep(self.answer_delay)
        error = "invalid grammar: bad rule" if self.invalid else ""
        return TaskAck(message.request.request_id, self.accept, error, self.invalid)

    def _bad(self, reason: str) -> TaskAck:
        return TaskAck("", False, reason)


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


def test_prefill_by_overlap_short_prompt_decode_only_and_status(nats_server):
    async def scenario() -> None:
        p1 = FakeWorker("p1", "prefill", cached=HASHES[:1])
        p2 = FakeWorker("p2", "prefill", cached=HASHES[:3])
        d1 = FakeWorker("d1", "decode", num_cached_blocks=1)
        async with mesh(nats_server.url, "s1", [p1, p2, d1]) as client:
            ack = await place(client, "s1", submit("r1"))
            assert ack == SubmitAck("r1", True, prefill_worker="p2", decode_worker="d1")
            assert [type(m) for m in d1.received] == [Reserve]
            (task,) = p2.received
            assert isinstance(task, PrefillTask)
            assert (task.decode_worker, task.skip_blocks) == ("d1", 1)
            assert task.request.prompt_token_ids == PROMPT

            short = await place(client, "s1", submit("r2", PROMPT[:10]))
            assert short == SubmitAck("r2", True, decode_worker="d1")
            assert isinstance(d1.received[-1], DecodeTask)

            mesh_status = await status(client, Subjects("s1"))
            assigned = {w.heartbeat.worker_id: w.assigned for w in mesh_status.workers}
            assert assigned == {"d1": ["r1", "r2"], "p1": [], "p2": ["r1"]}
            assert (mesh_status.admitted, mesh_status.rejected) == (2, 0)

    asyncio.run(scenario())


def test_refused_reservation_falls_back_and_failed_prefill_cancels(nats_server):
    async def scenario() -> None:
        d1 = FakeWorker("d1", "decode", free_blocks=150, reserve_ok=False)
        d2 = FakeWorker("d2", "decode", free_blocks=50)
        p1 = FakeWorker("p1", "prefill")
        async with mesh(nats_server.url, "s2", [d1, d2, p1]) as client:
            ack = await place(client, "s2", submit("r1"))
            assert (ack.accepted, ack.decode_worker, ack.prefill_worker) == (True, "d2", "p1")
            assert len(d1.received) == 1  # asked first (more free blocks), refused

            cancels: list[Cancel] = []
            await client.subscribe(Subjects("s2").cancel, Cancel, lambda m, h: _append(cancels, m))
            p1.accept = False
            refused = await place(client, "s2", submit("r2"))
            assert not refused.accepted and refused.retry_after > 0
            assert "prefill" in refused.error
            await asyncio.sleep(0.2)
            assert [c.request_id for c in cancels] == ["r2"]

    asyncio.run(scenario())


async def _append(items: list[Cancel], message: Cancel) -> None:
    items.append(message)


def test_no_workers_and_queue_bound_refuse_with_retry_after(nats_server):
    async def scenario() -> None:
        async with mesh(nats_server.url, "s3", []) as client:
            ack = await place(client, "s3", submit("r1"))
            assert not ack.accepted and ack.retry_after == 1.0
            assert ack.error == "no worker for role decode"

        slow = FakeWorker("d1", "both", answer_delay=0.5)
        async with mesh(nats_server.url, "s4", [slow], max_queue=1) as client:
            acks = await asyncio.gather(
                place(client, "s4", submit("r1")), place(client, "s4", submit("r2"))
            )
            assert sorted(a.accepted for a in acks) == [False, True]
            (refused,) = [a for a in acks if not a.accepted]
            assert refused.retry_after > 0 and "busy" in refused.error

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
            assert not ack.accepted and "cancelled" in ack.error
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
    the same on every worker: the scheduler stops at the first refusal, says `invalid` (the
    gateway answers 400 with the worker's message) and frees the reservation."""

    async def scenario() -> None:
        p1 = FakeWorker("p1", "prefill", cached=HASHES[:3], accept=False, invalid=True)
        p2 = FakeWorker("p2", "prefill")
        d1 = FakeWorker("d1", "decode")
        async with mesh(nats_server.url, "s9", [p1, p2, d1]) as client:
            cancels: list[Cancel] = []

            async def on_cancel(message: Cancel, headers: Headers) -> None:
                cancels.append(message)

            await client.subscribe(Subjects("s9").cancel, Cancel, on_cancel)
            await client.nc.flush()
            ack = await place(client, "s9", submit("bad"))
            assert not ack.accepted and ack.invalid and ack.retry_after == 0
            assert ack.error == "invalid grammar: bad rule"
            assert p2.received == []
            await asyncio.sleep(0.2)
            assert [c.request_id for c in cancels] == ["bad"]

    asyncio.run(scenario())
