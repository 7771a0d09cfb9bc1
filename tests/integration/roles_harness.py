"""The role-change tests' harness: a real scheduler and real workers in-process over a real
nats-server (`role_mesh`), and the test's gateway (`Gateway`): it submits requests, keeps
each one's tokens, and migrates an attempt that fails (an error chunk, an abort, or a
`WorkerLost` naming it) as services/gateway/migration.py does: a Cancel, then the prompt
and the tokens delivered so far as `<id>~<attempt>`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from services.worker.runtime import Worker
from shared.bus import Bus, Headers
from shared.config import CommonConfig
from shared.engine.sampling_params import SamplingParams
from shared.protocol import (
    Cancel,
    FinishReason,
    Heartbeat,
    MeshStatus,
    RequestFailed,
    SetRole,
    StatusQuery,
    SubmitAck,
    SubmitRequest,
    TaskAck,
    TokenChunk,
    WorkerLost,
)
from shared.subjects import Subjects
from tests.integration.test_worker import nats_only, until, worker_config

GATEWAY = "gw"


@dataclass
class Stream:
    """One request as its client sees it, across its attempts."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    attempt: int = 0
    tokens: list[int] = field(default_factory=list)  # delivered, in order
    finish: FinishReason | None = None
    placements: list[SubmitAck] = field(default_factory=list)  # one per attempt
    failures: list[str] = field(default_factory=list)  # why each migrated attempt failed

    @property
    def wire_id(self) -> str:
        return f"{self.request_id}~{self.attempt}" if self.attempt else self.request_id


class Gateway:
    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subjects = subjects
        self.streams: dict[str, Stream] = {}
        self._attempts: dict[str, Stream] = {}  # wire id → its stream
        self._sending: set[asyncio.Task[SubmitAck]] = set()

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.tokens(GATEWAY), TokenChunk, self._on_chunk)
        await self.bus.subscribe(self.subjects.events, (RequestFailed, WorkerLost), self._on_event)
        await self.bus.nc.flush()

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> SubmitAck:
        stream = Stream(request_id, list(prompt), params)
        self.streams[request_id] = stream
        return await self._send(stream)

    async def finished(self, timeout: float = 60.0) -> None:
        await until(lambda: all(s.finish is not None for s in self.streams.values()), timeout)

    async def _send(self, stream: Stream) -> SubmitAck:
        self._attempts[stream.wire_id] = stream
        request = SubmitRequest(
            stream.wire_id,
            GATEWAY,
            stream.prompt,
            stream.params,
            time.time() + 90,
            stream.attempt,
            list(stream.tokens),
        )
        ack = await self.bus.request(self.subjects.submit, request, SubmitAck, timeout=80)
        stream.placements.append(ack)
        if not ack.accepted:
            stream.failures.append(f"refused: {ack.error}")
            stream.finish = FinishReason.ABORT
        return ack

    async def _on_chunk(self, chunk: TokenChunk, headers: Headers) -> None:
        stream = self._attempts.get(chunk.request_id)
        if stream is None or stream.wire_id != chunk.request_id or stream.finish is not None:
            return  # a late chunk of an attempt given up
        if chunk.error or chunk.finish_reason == FinishReason.ABORT:
            await self._migrate(stream, chunk.error or "aborted")
            return
        if chunk.index > len(stream.tokens):
            stream.failures.append(f"gap: chunk at {chunk.index}, {len(stream.tokens)} held")
            stream.finish = FinishReason.ABORT
            return
        stream.tokens += chunk.token_ids[len(stream.tokens) - chunk.index :]  # no duplicates
        stream.finish = chunk.finish_reason

    async def _on_event(self, event: RequestFailed | WorkerLost, headers: Headers) -> None:
        if not isinstance(event, WorkerLost):
            return
        for wire_id in event.request_ids:
            stream = self._attempts.get(wire_id)
            if stream is not None and stream.wire_id == wire_id and stream.finish is None:
                await self._migrate(stream, f"worker {event.worker_id} lost")

    async def _migrate(self, stream: Stream, why: str) -> None:
        stream.failures.append(why)
        await self.bus.publish(self.subjects.cancel, Cancel(stream.wire_id, "migrated"))
        stream.attempt += 1
        task = asyncio.create_task(self._send(stream))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)


@dataclass
class RoleMesh:
    url: str
    namespace: str
    model_dir: Path
    bus: Bus  # the test's: scheduler client, gateway, heartbeat listener
    gateway: Gateway
    workers: dict[str, Worker]
    beats: dict[str, Heartbeat] = field(default_factory=dict)  # the latest of each worker

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)

    async def on_beat(self, beat: Heartbeat, headers: Headers) -> None:
        self.beats[beat.worker_id] = beat

    async def add_worker(self, worker_id: str, role: str, **overrides: float) -> Worker:
        config = worker_config(self.url, self.namespace, role, self.model_dir)
        worker = Worker(
            replace(config, worker_id=worker_id, **overrides), transport_factory=nats_only
        )
        await worker.start()
        self.workers[worker_id] = worker
        return worker

    async def set_role(self, worker_id: str, role: str, hurry: bool = False) -> TaskAck:
        message = SetRole(role, hurry)
        return await self.bus.request(self.subjects.role(worker_id), message, TaskAck, 5)

    async def status(self) -> MeshStatus:
        return await self.bus.request(self.subjects.status, StatusQuery(), MeshStatus, 2)

    async def scheduler_sees(
        self, worker_id: str, role: str, next_role: str = "", timeout: float = 15.0
    ) -> None:
        """Until the scheduler's view of the worker has this role and next role."""
        wanted = (worker_id, role, next_role)
        give_up = time.monotonic() + timeout
        while True:
            beats = [w.heartbeat for w in (await self.status()).workers]
            if wanted in [(b.worker_id, b.role, b.next_role) for b in beats]:
                return
            assert time.monotonic() < give_up, f"the scheduler never saw {wanted}: {beats}"
            await asyncio.sleep(0.05)

    def announced(self, worker_id: str, role: str) -> bool:
        """Its latest heartbeat serves `role` and is not changing."""
        beat = self.beats.get(worker_id)
        return beat is not None and beat.role == role and not beat.next_role


@asynccontextmanager
async def role_mesh(url: str, model_dir: Path, roles: dict[str, str]) -> AsyncIterator[RoleMesh]:
    """A scheduler, the workers of `roles` (worker id → role) and the test's gateway; every
    in-process worker's request table must end empty."""
    namespace = f"r{time.monotonic_ns()}"
    subjects = Subjects(namespace)
    config = SchedulerConfig(common=CommonConfig(url, namespace), sweep_interval=0.1)
    scheduler_bus = await Bus.connect(url, "scheduler")
    scheduler = SchedulerService(config, scheduler_bus)
    await scheduler.start()
    bus = await Bus.connect(url, "test")
    mesh = RoleMesh(url, namespace, model_dir, bus, Gateway(bus, subjects), {})
    await bus.subscribe(subjects.heartbeat, Heartbeat, mesh.on_beat)
    await mesh.gateway.start()
    try:
        for worker_id, role in roles.items():
            await mesh.add_worker(worker_id, role)
            await mesh.scheduler_sees(worker_id, role)
        yield mesh
        await until(lambda: not any(len(w.table) for w in mesh.workers.values()), timeout=10)
    finally:
        for worker in mesh.workers.values():
            await worker.shutdown()
        await scheduler.stop()
        await bus.close()
        await scheduler_bus.close()
