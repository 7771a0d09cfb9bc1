"""Every subject a service serves or subscribes to, fuzzed (hypothesis): random bytes,
other message kinds, valid msgpack of the wrong shape, old schema versions, out-of-range
values and huge arrays. Each bad frame is refused before any handler runs: counted in
`splitserve_wire_rejected_total{subject}`, logged, answered with a refusal where the
subject is request/reply, and the service's state is what it was. A valid frame on the
same subject does reach the handler (so the harness can tell the difference).

The scheduler and the gateway's token streams run for real over a recording stand-in for
the NATS client; the worker's subjects go through the same `Bus.serve`/`subscribe` and
`serve_kv` paths with handlers that record any call; `splitserve up`'s pool link (the
PoolTargets it follows) subscribes through `Bus.subscribe` for real.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from nats.aio.msg import Msg

from services.gateway.streams import TokenStreams
from services.pool_link import PoolLink
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared.bus import Bus
from shared.kvtransfer.nats_transport import serve_kv
from shared.liveness_messages import Probe, ProbeAck
from shared.lora_messages import AdapterAnswer, AdapterCommand, AdapterReport
from shared.nats_options import NatsAuth
from shared.planner_messages import PlannerReport
from shared.pool_messages import PoolTarget
from shared.prefix_messages import PrefixPin, PrefixPinned
from shared.protocol import (
    Cancel,
    DecodeTask,
    Heartbeat,
    KVChunk,
    KVDone,
    KVEvents,
    KVReady,
    MeshStatus,
    Outcome,
    PrefillTask,
    RequestFailed,
    Reservation,
    Reserve,
    SetRole,
    StatusQuery,
    SubmitAck,
    SubmitRequest,
    TaskAck,
    TokenChunk,
    WorkerLost,
    decode,
    encode,
)
from shared.sleep_level import SleepLevel
from shared.sleep_messages import SleepCommand, SleepReply
from shared.subjects import Subjects
from shared.wire_codec import MAX_FRAME_BYTES, MAX_LIST_ITEMS
from tests.unit.wire_samples import SAMPLE, SUBMIT, bad_frames, plain


class RecordingNats:
    """Stands in for nats-py's client: keeps subscription callbacks and what is published."""

    def __init__(self) -> None:
        self.callbacks: dict[str, Callable] = {}
        self.published: list[tuple[str, bytes]] = []
        self.max_payload = 8 * 2**20

    async def subscribe(self, subject: str, queue: str = "", cb=None):
        self.callbacks[subject] = cb

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "", headers=None):
        self.published.append((subject, payload))

    async def flush(self, timeout: float = 1.0) -> None:
        return None


class Harness:
    """One service's subscriptions, a way to deliver a frame, and a view of its state."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.nats = RecordingNats()
        self.bus = Bus(self.nats)  # type: ignore[arg-type]
        self.calls: list[Any] = []

    def deliver(self, subject: str, data: bytes) -> Any:
        """The reply to `data` on `subject` (None: none sent)."""
        self.nats.published.clear()
        msg = Msg(self.nats, subject, "_INBOX.test.1", data)  # type: ignore[arg-type]
        self.loop.run_until_complete(self.nats.callbacks[subject](msg))
        self.loop.run_until_complete(asyncio.sleep(0))  # concurrent handlers run
        self.loop.run_until_complete(asyncio.sleep(0))
        replies = [p for s, p in self.nats.published if s == "_INBOX.test.1"]
        return replies[0] if replies else None

    def record(self, name: str):
        async def handler(message: Any, headers: Any) -> Any:
            self.calls.append((name, message))
            return TaskAck(message.request_id, Outcome.OK)

        return handler


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def scheduler_harness(loop) -> tuple[Harness, Callable[[], Any]]:
    harness = Harness(loop)
    service = SchedulerService(SchedulerConfig(), harness.bus)
    loop.run_until_complete(service.start())
    service._sweeper.cancel()  # expiry must not change the state between two looks
    harness.deliver("ss.workers.heartbeat", encode(Heartbeat("w0", "both", "m", 0, 0, 8, 8, 16)))
    harness.deliver("ss.kv.events", encode(KVEvents("w0", 0, [7], [])))

    def state() -> Any:
        registry = service.registry.status(), service.registry.views()
        counts = service.placing, service.admitted, service.rejected
        return registry, counts, service.cancelled, service.planner_report

    return harness, lambda: repr(state())


def gateway_harness(loop) -> tuple[Harness, Callable[[], Any]]:
    harness = Harness(loop)
    streams = TokenStreams(harness.bus, Subjects("ss"), "g1")
    loop.run_until_complete(streams.start())
    stream = streams.open_stream("r1")
    return harness, lambda: (stream.queue.qsize(), stream.next_index, stream.received)


def worker_harness(loop) -> tuple[Harness, Callable[[], Any]]:
    harness, s = Harness(loop), Subjects("ss")
    bus = harness.bus

    def refuse(reason: str) -> TaskAck:
        return TaskAck("", Outcome.INVALID, reason)

    def refuse_reserve(reason: str) -> Reservation:
        return Reservation("", Outcome.INVALID, error=reason)

    class KV:
        on_chunk = on_done = on_ready = staticmethod(harness.record("kv"))

    async def set_role(message: SetRole, headers: Any) -> TaskAck:
        harness.calls.append(("role", message))
        return TaskAck("", Outcome.OK)

    async def adapter_command(message: AdapterCommand, headers: Any) -> AdapterAnswer:
        harness.calls.append(("adapters", message))
        return AdapterAnswer("w1", Outcome.OK)

    def refuse_adapter(reason: str) -> AdapterAnswer:
        return AdapterAnswer("w1", Outcome.INVALID, reason)

    async def probe(message: Probe, headers: Any) -> ProbeAck:
        harness.calls.append(("probe", message))
        return ProbeAck("w1", 7)

    async def sleep(message: SleepCommand, headers: Any) -> SleepReply:
        harness.calls.append(("sleep", message))
        return SleepReply("w1", message.level)

    def refuse_sleep(reason: str) -> SleepReply:
        return SleepReply("w1", SleepLevel.AWAKE, Outcome.INVALID, reason)

    async def pin(message: PrefixPin, headers: Any) -> PrefixPinned:
        harness.calls.append(("prefix", message))
        return PrefixPinned(message.pin_id, Outcome.UNAVAILABLE, "no blocks")

    def refuse_pin(reason: str) -> PrefixPinned:
        return PrefixPinned("?", Outcome.INVALID, reason)

    async def subscribe() -> None:
        await bus.serve(s.prefix("w1"), PrefixPin, pin, refuse_pin)
        await bus.serve(s.probe("w1"), Probe, probe, lambda r: ProbeAck("", 0, Outcome.INVALID, r))
        await bus.serve(s.sleep("w1"), SleepCommand, sleep, refuse_sleep)
        await bus.serve(s.reserve("w1"), Reserve, harness.record("reserve"), refuse_reserve)
        await bus.serve(s.prefill("w1"), PrefillTask, harness.record("prefill"), refuse)
        await bus.serve(s.decode("w1"), DecodeTask, harness.record("decode"), refuse)
        await serve_kv(bus, s.kv("w1"), KV())
        await bus.serve(s.role("w1"), SetRole, set_role, refuse)
        await bus.serve(s.worker_adapters("w1"), AdapterCommand, adapter_command, refuse_adapter)
        await bus.subscribe(s.cancel, Cancel, harness.record("cancel"))
        await bus.subscribe(s.events, (RequestFailed, WorkerLost), harness.record("events"))

    loop.run_until_complete(subscribe())
    return harness, lambda: len(harness.calls)


def launcher_harness(loop) -> tuple[Harness, Callable[[], Any]]:
    """`splitserve up`'s pool link: the target it would follow."""
    harness = Harness(loop)
    link = PoolLink("nats://unused", NatsAuth(), Subjects("ss"))
    loop.run_until_complete(link.listen(harness.bus))
    return harness, lambda: repr(link.target())


@dataclasses.dataclass(frozen=True)
class Case:
    service: str  # "scheduler" | "gateway" | "worker" | "launcher"
    subject: str
    kinds: tuple[type, ...]
    reply: type | None = None  # request/reply: the type of its refusal
    control: bool = True  # does a valid frame change the state (placing one would wait)

    def __str__(self) -> str:
        return f"{self.service}:{self.subject}"


CASES = [
    Case("scheduler", "ss.sched.submit", (SubmitRequest,), SubmitAck, control=False),
    Case("scheduler", "ss.sched.status", (StatusQuery,), MeshStatus, control=False),
    Case("scheduler", "ss.workers.heartbeat", (Heartbeat,)),
    Case("scheduler", "ss.kv.events", (KVEvents,)),
    Case("scheduler", "ss.cancel", (Cancel,)),
    Case("scheduler", "ss.planner.report", (PlannerReport,)),
    Case("scheduler", "ss.sched.adapters", (AdapterCommand,), AdapterReport, control=False),
    Case("gateway", "ss.gateway.g1.tokens", (TokenChunk,)),
    Case("gateway", "ss.events", (RequestFailed, WorkerLost), control=False),
    Case("worker", "ss.worker.w1.reserve", (Reserve,), Reservation),
    Case("worker", "ss.worker.w1.prefill", (PrefillTask,), TaskAck),
    Case("worker", "ss.worker.w1.decode", (DecodeTask,), TaskAck),
    Case("worker", "ss.worker.w1.kv", (KVChunk, KVDone, KVReady), TaskAck),
    Case("worker", "ss.worker.w1.role", (SetRole,), TaskAck),
    Case("worker", "ss.worker.w1.adapters", (AdapterCommand,), AdapterAnswer),
    Case("worker", "ss.worker.w1.probe", (Probe,), ProbeAck),
    Case("worker", "ss.worker.w1.prefix", (PrefixPin,), PrefixPinned),
    Case("worker", "ss.worker.w1.sleep", (SleepCommand,), SleepReply),
    Case("worker", "ss.cancel", (Cancel,)),
    Case("worker", "ss.events", (RequestFailed, WorkerLost)),
    Case("launcher", "ss.pool.target", (PoolTarget,)),
]
HARNESSES = {
    "scheduler": scheduler_harness,
    "gateway": gateway_harness,
    "worker": worker_harness,
    "launcher": launcher_harness,
}


def assert_refused(harness: Harness, case: Case, state: Callable[[], Any], frame: bytes) -> None:
    before, count = state(), harness.bus.rejections.count(case.subject)
    reply = harness.deliver(case.subject, frame)
    assert state() == before
    assert harness.bus.rejections.count(case.subject) == count + 1
    if case.reply is not None:
        answer = decode(reply, case.reply)
        if case.reply is AdapterReport:
            assert not answer.ok
        else:
            assert case.reply is MeshStatus or answer.outcome != Outcome.OK


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_frames_are_refused_counted_and_change_nothing(case: Case, loop) -> None:
    harness, state = HARNESSES[case.service](loop)

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(frame=bad_frames(case.kinds))
    def fuzz(frame: bytes) -> None:
        assert_refused(harness, case, state, frame)

    fuzz()
    if case.control:
        before = state()
        for kind in case.kinds:
            harness.deliver(case.subject, encode(SAMPLE[kind]))
        assert state() != before


@pytest.mark.parametrize(
    ("service", "subject", "message", "field"),
    [
        ("scheduler", "ss.sched.submit", SUBMIT, "prompt_token_ids"),
        ("scheduler", "ss.kv.events", SAMPLE[KVEvents], "stored"),
        ("gateway", "ss.events", SAMPLE[WorkerLost], "request_ids"),
        ("worker", "ss.worker.w1.kv", SAMPLE[KVChunk], "block_hashes"),
    ],
    ids=["submit-tokens", "kv-event-hashes", "lost-request-ids", "kv-chunk-hashes"],
)
def test_huge_arrays_are_refused(service: str, subject: str, message, field: str, loop) -> None:
    """Lists past the bound, yet frames under the size limit."""
    harness, state = HARNESSES[service](loop)
    case = next(c for c in CASES if c.service == service and c.subject == subject)
    version, name, fields = plain(message)
    item = fields[field][0] if fields[field] else 1
    huge = fields | {field: [item] * (MAX_LIST_ITEMS + 1)}
    assert_refused(harness, case, state, msgpack.packb([version, name, huge], use_bin_type=True))


def test_an_oversized_frame_is_refused_and_the_log_names_subject_not_payload(loop, caplog):
    harness, state = scheduler_harness(loop)
    case = next(c for c in CASES if c.subject == "ss.workers.heartbeat")
    assert_refused(harness, case, state, b"secret-prompt" * (MAX_FRAME_BYTES // 13 + 1))
    assert_refused(harness, case, state, b"secret-prompt")
    assert "rejected a frame on ss.workers.heartbeat" in caplog.text
    assert "secret-prompt" not in caplog.text
