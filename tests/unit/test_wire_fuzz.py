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
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg

from services.gateway.streams import TokenStreams
from services.pool_link import PoolLink
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared.bus import Bus
from shared.engine.sampling_params import SamplingParams
from shared.engine.startup_phases import StartupPhase
from shared.kvtransfer.nats_transport import serve_kv
from shared.liveness_messages import Probe, ProbeAck
from shared.lora_messages import AdapterAction, AdapterAnswer, AdapterCommand, AdapterReport
from shared.nats_options import NatsAuth
from shared.planner_messages import PlannerReport, ReportedDecision
from shared.pool_messages import PoolTarget
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
from shared.startup_messages import PhaseTime
from shared.subjects import Subjects
from shared.wire_codec import MAX_FRAME_BYTES, MAX_LIST_ITEMS, SCHEMA_VERSION

DECIDED = ReportedDecision(1.0, "add", "ttft_over_slo", "prefill")
SUBMIT = SubmitRequest("r1", "g1", [1, 2, 3], SamplingParams(), deadline=time.time() + 600)
SAMPLES: list[Any] = [
    SUBMIT,
    StatusQuery(),
    Heartbeat(
        "w1", "decode", "m", 0, 0, 10, 10, 16, startup=[PhaseTime(StartupPhase.IMPORTS, 1.5)]
    ),
    KVEvents("w0", 1, [1], []),
    Reserve(SUBMIT),
    PrefillTask(SUBMIT, "w2", 0),
    DecodeTask(SUBMIT),
    SetRole("prefill"),
    KVChunk("r1", 0, 0, 1, 0, [None], "float32", [1, 1, 16, 2, 1, 4], bytes(512)),
    KVDone("r1", 1, 5),
    KVReady("r1", "nixl", "a", b"m", 10, [1, 16, 2, 1, 4], "float32", 0, [1], [None], 5, 1e10),
    TokenChunk("r1", 0, [5]),
    Cancel("r1"),
    WorkerLost("w1", ["r1"]),
    RequestFailed("r1", "x"),
    PlannerReport("planner", 1, 1.0, "replicas", "", 1.0, 0.04, 1, 1, 0, decisions=[DECIDED]),
    PoolTarget("planner-0", 3, "", 1, 2, 0, "queue"),
    AdapterCommand(AdapterAction.LOAD, "sql-lora", "/adapters/sql", "m"),
    AdapterAnswer("w1", Outcome.OK),
    AdapterReport([AdapterAnswer("w1", Outcome.OK)]),
    Probe("w1", 7),
    ProbeAck("w1", 7),
    SleepCommand(SleepLevel.KV_FREED, 5.0),
    SleepReply("w1", SleepLevel.AWAKE),
]
SAMPLE = {type(m): m for m in SAMPLES}
# Values out of range per message: (path of the field, a bad value). Paths go into nested
# dataclasses with dots.
NEGATIVE = st.integers(-(2**63), -1)
HUGE = st.integers(min_value=2**63, max_value=2**64 - 1)
BAD_ID = st.sampled_from(["", "a.b", "x y", "*", ">", "é", "x" * 300])
REQUEST_BOUNDS = {
    "request_id": st.just(""),
    "gateway_id": BAD_ID,
    "prompt_token_ids": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
    "delivered_token_ids": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
    "attempt": NEGATIVE,
    "deadline": st.sampled_from([float("nan"), float("inf")]),
    "submitted_at": st.sampled_from([float("nan"), float("-inf"), -1.0]),
    "sampling.temperature": st.floats(max_value=-0.01),
    "sampling.top_p": st.floats(min_value=1.01, max_value=1e9),
    "sampling.adapter": st.sampled_from([" ", "a b", "x" * 300, "a\x00b"]),
    "tenant": BAD_ID.filter(bool),
    "priority": st.integers(2**31, 2**62) | st.integers(-(2**62), -(2**31)),
}
DECISION = {"time": 1.0, "action": "add", "reason": "kv_full", "role": "decode"}
DECISION |= {"worker_id": "", "detail": "", "outcome": ""}
BOUNDS: dict[type, dict[str, st.SearchStrategy]] = {
    SubmitRequest: REQUEST_BOUNDS,
    Heartbeat: {
        "worker_id": BAD_ID,
        "role": st.sampled_from(["", "gateway", "prefil"]),
        "num_running": NEGATIVE | HUGE,
        "free_blocks": st.integers(11, 2**40),  # > total_blocks
        "block_size": st.integers(-(2**63), 0) | st.integers(4097, 2**62),
        "metrics_port": st.integers(65536, 2**62) | NEGATIVE,
        "kv_blocks_sent": NEGATIVE,
        "prefill_rate": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "busy": st.floats(max_value=-1e-9),
        "ready_s": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "next_role": st.sampled_from(["gateway", "prefil", "BOTH"]),
        "kv_tier.hits": NEGATIVE,
        "kv_tier.load_seconds": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "stream_tpots": st.lists(
            st.sampled_from([float("nan"), float("inf"), -1.0]), min_size=1, max_size=3
        ),
    },
    KVEvents: {
        "worker_id": BAD_ID,
        "seq_no": NEGATIVE | HUGE,
        "stored": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "removed": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "tier_stored": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
    },
    Reserve: {f"request.{k}": v for k, v in REQUEST_BOUNDS.items()},
    PrefillTask: {
        **{f"request.{k}": v for k, v in REQUEST_BOUNDS.items()},
        "decode_worker": BAD_ID,
        "skip_blocks": NEGATIVE,
        "decode_epoch": NEGATIVE | HUGE,
    },
    DecodeTask: {f"request.{k}": v for k, v in REQUEST_BOUNDS.items()},
    SetRole: {"role": st.sampled_from(["", "gateway", "prefil", "Decode", "x" * 300])},
    KVChunk: {
        "request_id": st.just(""),
        "chunk_index": NEGATIVE,
        "layer_start": st.integers(1, 2**62) | NEGATIVE,  # >= layer_end, or < 0
        "first_block": NEGATIVE,
        "dtype": st.sampled_from(["int8", "float64", ""]),
        "shape": st.lists(st.integers(-(2**62), 0), min_size=6, max_size=6)
        | st.lists(st.integers(1, 4), max_size=5),
        "block_hashes": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
    },
    KVDone: {"request_id": st.just(""), "num_chunks": NEGATIVE, "first_token_id": NEGATIVE | HUGE},
    KVReady: {
        "num_cache_blocks": NEGATIVE,
        "block_ids": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "block_hashes": st.lists(NEGATIVE | HUGE, min_size=1, max_size=1),
        "layout": st.lists(st.integers(1, 4), max_size=4),
        "first_token_id": NEGATIVE,
        "read_by": st.just(float("nan")),
        "epoch": NEGATIVE,
        "to_epoch": HUGE,
    },
    TokenChunk: {
        "request_id": st.just("x" * 300),
        "index": NEGATIVE | HUGE,
        "token_ids": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "num_prompt_tokens": NEGATIVE,
    },
    Cancel: {"request_id": st.just("")},
    WorkerLost: {"worker_id": BAD_ID},
    RequestFailed: {"request_id": st.just("")},
    PlannerReport: {
        "planner_id": BAD_ID,
        "seq_no": NEGATIVE | HUGE,
        "mode": st.sampled_from(["", "auto", "Roles"]),
        "time": st.sampled_from([float("nan"), float("inf")]),
        "ttft_slo": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "decode": NEGATIVE | st.integers(1 << 16, 2**62),
        "decisions": st.lists(st.just(DECISION), min_size=21, max_size=22),  # > MAX_REPORTED
    },
    AdapterCommand: {
        "name": st.sampled_from(["", "a b", "x" * 300, ".x"]),
        "path": st.just("x" * 5000),
        "model": st.just("x" * 300),
    },
    Probe: {"worker_id": st.sampled_from(["a.b", "x y", "*", "x" * 300]), "epoch": NEGATIVE},
    PoolTarget: {
        "publisher": st.sampled_from(["", "x" * 300]),
        "seq_no": NEGATIVE | HUGE,
        "prefill": NEGATIVE | st.integers(1 << 16, 2**62),
        "decode": NEGATIVE,
        "both": NEGATIVE,
        "reason": st.just("x" * 5000),
    },
}
PACKABLE_INT = st.integers(-(2**63), 2**64 - 1)  # what msgpack can hold
PLAIN = st.none() | st.booleans() | PACKABLE_INT | st.floats() | st.text() | st.binary()
MSGPACK_VALUES = st.recursive(
    PLAIN,
    lambda inner: st.lists(inner) | st.dictionaries(st.text() | PACKABLE_INT, inner),
    max_leaves=12,
)


def plain(message: Any) -> list:
    """The frame of `message` as msgpack values: [version, type, fields]."""
    return msgpack.unpackb(encode(message), raw=False, strict_map_key=False)


def with_value(fields: dict, path: str, value: Any) -> dict:
    head, _, rest = path.partition(".")
    if rest:
        return fields | {head: with_value(fields[head], rest, value)}
    return fields | {head: value}


@st.composite
def bad_frames(draw: st.DrawFn, kinds: tuple[type, ...]) -> bytes:
    """One frame no receiver of `kinds` may accept."""
    kind = draw(st.sampled_from(kinds))
    version, name, fields = plain(SAMPLE[kind])
    others = [m for m in SAMPLES if type(m) not in kinds]
    how = draw(st.sampled_from(["bytes", "msgpack", "kind", "version", "shape", "range"]))
    if how == "bytes":
        return draw(st.binary(max_size=200))
    if how == "msgpack":
        return msgpack.packb(draw(MSGPACK_VALUES), use_bin_type=True)
    if how == "kind":
        return encode(draw(st.sampled_from(others)))
    if how == "version":
        old = draw(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != SCHEMA_VERSION))
        return msgpack.packb([old, name, fields], use_bin_type=True)
    if how == "shape":
        shape = draw(st.sampled_from(["missing", "extra", "type", "frame"]))
        required = sorted(f.name for f in dataclasses.fields(kind) if _required(f))
        if shape == "frame" or not fields:
            return msgpack.packb(draw(st.lists(PLAIN, max_size=5)), use_bin_type=True)
        if shape == "missing" and required:
            gone = draw(st.sampled_from(required))
            fields = {k: v for k, v in fields.items() if k != gone}
        elif shape == "type":
            # a field the sample leaves None says nothing of the type it takes
            field = draw(st.sampled_from(sorted(k for k, v in fields.items() if v is not None)))
            fields = fields | {field: draw(PLAIN.filter(lambda v: _misfits(v, fields[field])))}
        else:
            fields = fields | {"zz_unknown": 1}
        return msgpack.packb([version, name, fields], use_bin_type=True)
    bounds = BOUNDS.get(kind, {})
    if not bounds:
        return encode(draw(st.sampled_from(others)))
    path = draw(st.sampled_from(sorted(bounds)))
    return msgpack.packb([version, name, with_value(fields, path, draw(bounds[path]))])


def _misfits(value: Any, original: Any) -> bool:
    """Is `value` of another type than a field holding `original` takes? (None fits the
    optional fields, an int fits a float field.)"""
    numbers = (int, float)
    if value is None or (isinstance(value, numbers) and isinstance(original, numbers)):
        return isinstance(value, bool) != isinstance(original, bool) and value is not None
    return type(value) is not type(original)


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


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

    async def subscribe() -> None:
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
