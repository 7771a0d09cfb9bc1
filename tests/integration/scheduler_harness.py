"""The scheduler integration tests' harness: fake workers written on `Bus` (heartbeats, KV
events, reservations and tasks answered as scripted), a mesh of them around a real
SchedulerService, and the clients' calls (status, place, cancels)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared.bus import Bus, Headers
from shared.config import CommonConfig
from shared.engine.block_hash import hash_full_blocks
from shared.engine.sampling_params import SamplingParams
from shared.liveness_messages import Probe, ProbeAck
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
    epoch: int = 1  # its process's: in its heartbeats and probe answers
    # Probes: None: it does not subscribe (the scheduler hears "no responders", as for a
    # dead process); else it answers after this many seconds (a frozen one: never in time).
    probe_delay: float | None = None
    probes: int = 0  # probes it received

    async def start(self, bus: Bus, subjects: Subjects) -> None:
        self.bus, self.subjects = bus, subjects
        await bus.serve(subjects.reserve(self.worker_id), Reserve, self._reserve, self._bad)
        await bus.serve(subjects.prefill(self.worker_id), PrefillTask, self._task, self._bad)
        await bus.serve(subjects.decode(self.worker_id), DecodeTask, self._task, self._bad)
        if self.probe_delay is not None:
            probe = subjects.probe(self.worker_id)
            await bus.serve(probe, Probe, self._probe, self._bad, concurrent=True)
        await self.beat()
        await bus.publish(subjects.kv_events, KVEvents(self.worker_id, 0, stored=self.cached))
        self._beats = asyncio.create_task(self._beat_forever())

    async def beat(self) -> None:
        self.room = self.room_per_beat
        heartbeat = Heartbeat(
            self.worker_id, self.role, "m", 0, self.busy_answers, self.free_blocks, 200, 16
        )
        heartbeat.epoch = self.epoch
        await self.bus.publish(self.subjects.heartbeat, heartbeat)

    def silence(self) -> None:
        """No heartbeat from now on (its subscriptions stay: it still answers)."""
        self.beating = False
        self._beats.cancel()

    def resume(self) -> None:
        self.beating = True
        self._beats = asyncio.create_task(self._beat_forever())

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

    async def _probe(self, message: Probe, headers: Headers) -> ProbeAck:
        self.probes += 1
        await asyncio.sleep(self.probe_delay or 0.0)
        return ProbeAck(self.worker_id, self.epoch)

    def _bad(self, reason: str) -> TaskAck:
        return TaskAck("", Outcome.INVALID, reason)


def submit(request_id: str, prompt: list[int] = PROMPT) -> SubmitRequest:
    return SubmitRequest(request_id, "gw1", prompt, SamplingParams(), time.time() + 30)


@asynccontextmanager
async def mesh(
    url: str,
    namespace: str,
    workers: list[FakeWorker],
    services: list[SchedulerService] | None = None,
    **config: object,
) -> AsyncIterator[Bus]:
    """A scheduler and the fake workers on `namespace`; yields a client bus once the
    scheduler has heard from every worker. The scheduler goes into `services`, if given
    (for its metrics)."""
    subjects = Subjects(namespace)
    settings = dict(heartbeat_timeout=1.0, sweep_interval=0.1) | config
    sched_bus = await Bus.connect(url, "scheduler")
    common = CommonConfig(url, namespace)
    service = SchedulerService(SchedulerConfig(common=common, **settings), sched_bus)
    await service.start()
    if services is not None:
        services.append(service)
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
