"""The planner service over a recording stand-in for NATS: heartbeats in; each round's
decisions carried out (SetRole to the worker, a whole PoolTarget for ADD/DRAIN), counted in
/metrics, reported on planner.report; and the scheduler keeping the newest report for
/mesh. Rounds are driven by hand (`round()`), on a hand-set clock."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import pytest
from nats.aio.msg import Msg

from services.planner.config import PlannerConfig, PlannerServiceConfig
from services.planner.service import PlannerService
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared.bus import Bus
from shared.errors import ConfigError
from shared.planner_messages import PlannerReport
from shared.pool_messages import PoolTarget
from shared.protocol import (
    FirstToken,
    Heartbeat,
    Outcome,
    SetRole,
    StatusQuery,
    TaskAck,
    decode,
    encode,
)
from shared.slo import parse_slo

POLICY = PlannerConfig(hold=2, cooldown=0.0, min_samples=3)


@dataclass
class Reply:
    data: bytes


class RecordingNats:
    """Keeps subscriptions and publications; answers SetRole requests with `ack`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ack: TaskAck | None = None) -> None:
        self.loop = loop
        self.callbacks: dict[str, Any] = {}
        self.published: list[tuple[str, bytes]] = []
        self.requests: list[tuple[str, bytes]] = []
        self.ack = ack or TaskAck("", Outcome.OK)

    async def subscribe(self, subject: str, queue: str = "", cb=None):
        self.callbacks[subject] = cb

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "", headers=None):
        self.published.append((subject, payload))

    async def request(self, subject: str, payload: bytes, timeout: float = 1.0, headers=None):
        self.requests.append((subject, payload))
        return Reply(encode(self.ack))

    async def flush(self, timeout: float = 1.0) -> None:
        return None

    def deliver(self, subject: str, message: Any) -> None:
        msg = Msg(self, subject, "", encode(message))  # type: ignore[arg-type]
        self.loop.run_until_complete(self.callbacks[subject](msg))

    def sent(self, subject: str, kind: type) -> list[Any]:
        return [decode(data, kind) for s, data in self.published if s == subject]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str, role: str, tpot: float = 0.02, ttft: float = 0.3) -> Heartbeat:
    return Heartbeat(
        worker_id, role, "m", 2, 0, 50, 100, 16, busy=0.5, prefill_rate=1000.0,
        first_tokens=[FirstToken(f"{worker_id}-{i}", ttft) for i in range(3)],
        stream_tpots=[tpot] * 3,
    )  # fmt: skip


@pytest.fixture()
def loop():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()


def planner_on(loop, nats: RecordingNats, policy: PlannerConfig) -> tuple[PlannerService, Clock]:
    clock = Clock()
    config = PlannerServiceConfig(policy=policy, planner_id="pl-1")
    service = PlannerService(config, Bus(nats), clock)  # type: ignore[arg-type]
    subscribing = service.bus.subscribe(service.subjects.heartbeat, Heartbeat, service.on_heartbeat)
    loop.run_until_complete(subscribing)
    return service, clock


def rounds(loop, nats, service, clock, beats: list[Heartbeat], count: int) -> list[list]:
    made = []
    for _ in range(count):
        clock.now += 5.0
        for b in beats:
            nats.deliver("ss.workers.heartbeat", b)
        made.append(loop.run_until_complete(service.round()))
    return made


def test_replicas_mode_publishes_a_whole_target_counts_and_reports_it(loop):
    nats = RecordingNats(loop)
    service, clock = planner_on(loop, nats, POLICY)
    slow = [beat("p0", "prefill"), beat("d0", "decode", tpot=0.09)]
    assert rounds(loop, nats, service, clock, slow, 1) == [[]]
    assert nats.sent("ss.pool.target", PoolTarget) == []  # a planner that starts asks nothing
    metric = service.metrics.registry.get_sample_value
    desired = "splitserve_planner_desired_replicas"
    assert metric(desired, {"model": "", "role": "decode"}) == 1.0  # what the mesh has
    (decisions,) = rounds(loop, nats, service, clock, slow, 1)
    assert [(d.action.name, d.role) for d in decisions] == [("ADD", "decode")]
    (target,) = nats.sent("ss.pool.target", PoolTarget)
    assert (target.publisher, target.prefill, target.decode, target.both) == ("pl-1", 1, 2, 0)
    assert target.reason == "tpot_over_slo"
    assert metric(desired, {"model": "", "role": "decode"}) == 2.0
    labels = {"action": "add", "reason": "tpot_over_slo"}
    assert metric("splitserve_planner_decisions_total", labels) == 1.0
    report = nats.sent("ss.planner.report", PlannerReport)[-1]
    assert (report.planner_id, report.mode, report.decode, report.tpot_p99) == (
        "pl-1", "replicas", 2, pytest.approx(0.09),
    )  # fmt: skip
    (reported,) = report.decisions
    assert (reported.action, reported.reason, reported.role) == ("add", "tpot_over_slo", "decode")
    assert reported.outcome.startswith(f"target {target.seq_no} published")
    # The new worker joins: the next target builds on the counts it sees.
    grown = [*slow, beat("d1", "decode", tpot=0.09)]
    rounds(loop, nats, service, clock, grown, 2)
    later = nats.sent("ss.pool.target", PoolTarget)
    assert [t.decode for t in later] == [2, 3]
    assert later[1].seq_no > later[0].seq_no
    reports = nats.sent("ss.planner.report", PlannerReport)
    assert [r.seq_no for r in reports] == sorted({r.seq_no for r in reports})


def test_roles_mode_sends_set_role_and_a_refusal_ends_the_wait(loop):
    nats = RecordingNats(loop, TaskAck("", Outcome.UNAVAILABLE, "draining"))
    service, clock = planner_on(loop, nats, replace(POLICY, mode="roles"))
    aggregated = [beat("b0", "both", tpot=0.09), beat("b1", "both", tpot=0.09)]
    _, decisions = rounds(loop, nats, service, clock, aggregated, 2)
    assert {d.worker_id: d.role for d in decisions} == {"b0": "prefill", "b1": "decode"}
    asked = {s: decode(p, SetRole).role for s, p in nats.requests}
    assert asked == {"ss.worker.b0.role": "prefill", "ss.worker.b1.role": "decode"}
    assert nats.sent("ss.pool.target", PoolTarget) == []  # roles mode never asks for workers
    report = nats.sent("ss.planner.report", PlannerReport)[-1]
    assert {d.outcome for d in report.decisions} == {"refused: UNAVAILABLE draining"}
    # Refused: nothing to wait for, so the need (still there) acts again once it held.
    assert rounds(loop, nats, service, clock, aggregated, 2)[1] != []


def test_the_scheduler_keeps_the_newest_report_for_the_mesh_status(loop):
    nats = RecordingNats(loop)
    scheduler = SchedulerService(SchedulerConfig(), Bus(nats))  # type: ignore[arg-type]
    loop.run_until_complete(scheduler.start())
    status = loop.run_until_complete(scheduler.on_status(StatusQuery(), {}))
    assert status.planner is None
    report = PlannerReport("pl-1", 5, 1.0, "roles", "", 1.0, 0.04, 1, 1, 0)
    nats.deliver("ss.planner.report", report)
    nats.deliver("ss.planner.report", replace(report, seq_no=3, prefill=9))  # older: ignored
    status = loop.run_until_complete(scheduler.on_status(StatusQuery(), {}))
    assert status.planner == report
    loop.run_until_complete(scheduler.stop())


def test_slo_flag_parses_seconds_and_milliseconds():
    assert parse_slo("ttft=1,tpot=0.04") == (1.0, 0.04)
    assert parse_slo("tpot=40ms, ttft=2s") == (2.0, pytest.approx(0.04))
    for bad in ("ttft=1", "ttft=1,tpot=x", "ttft=1,tpot=2,ttft=3", "itl=1,tpot=2", ""):
        with pytest.raises(ConfigError):
            parse_slo(bad)
