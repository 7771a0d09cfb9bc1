"""The planner on NATS: heartbeats in; every `--planner-interval` a snapshot, a decision
round (services/planner/policy.py) and what the decisions ask for, then a report.

  SET_ROLE  `SetRole` to the worker (`<ns>.worker.<id>.role`), its `TaskAck` awaited for
            `role_timeout`; a refusal or no answer tells the policy the change did not start
  ADD/DRAIN the counts wanted change: a whole `PoolTarget` on `<ns>.pool.target` (`up`
            starts or drains workers to match) and the desired-replicas gauge (Kubernetes)
Each decision is logged with its reason and figures, counted in /metrics, traced as a
`planner.decision` span and kept (the last MAX_REPORTED) in the `PlannerReport` published
on `<ns>.planner.report` after every round (the scheduler keeps it for /mesh).

The subtle rule: until its first ADD or DRAIN the planner wants what the mesh has (so a
planner that starts, or restarts, asks for no change); from then on it wants what it last
published. `seq_no`s come from the clock, so a restarted planner's targets are newer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

from nats.errors import Error as NatsError

from services.planner.config import PlannerServiceConfig
from services.planner.counts import RoleCounts, counts_after
from services.planner.decision import Action, Decision
from services.planner.metrics import PlannerMetrics
from services.planner.policy import Planner
from services.planner.signals import MeshSignals
from services.planner.window import SignalWindow
from shared.bus import Bus, Headers
from shared.planner_messages import MAX_REPORTED, PlannerReport, ReportedDecision
from shared.pool_messages import PoolTarget
from shared.protocol import Heartbeat, SetRole, TaskAck
from shared.subjects import Subjects
from shared.telemetry.tracing import inject, setup_tracing

log = logging.getLogger(__name__)


class PlannerService:
    def __init__(
        self, config: PlannerServiceConfig, bus: Bus, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        self.bus = bus
        self.clock = clock
        self.subjects = Subjects(config.common.namespace)
        self.planner = Planner(config.policy)
        self.window = SignalWindow(
            config.planner_window, config.heartbeat_timeout, config.planner_model
        )
        self.metrics = PlannerMetrics(config.planner_model)
        self.tracing = setup_tracing("planner", config.common.otlp_endpoint, config.planner_id)
        self.desired: RoleCounts | None = None  # None: what the mesh has (no target yet)
        self.recent: deque[ReportedDecision] = deque(maxlen=MAX_REPORTED)
        self._seq_no = 0
        self._signals = MeshSignals(0.0, ())
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.heartbeat, Heartbeat, self.on_heartbeat)
        await self.bus.nc.flush()
        self._loop = asyncio.create_task(self._plan_forever())

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop

    async def on_heartbeat(self, beat: Heartbeat, headers: Headers) -> None:
        self.window.add(beat, self.clock())

    async def _plan_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.planner_interval)
            try:
                await self.round()
            except Exception:
                log.exception("planner round failed")

    async def round(self) -> list[Decision]:
        """One snapshot, its decisions carried out, the report published."""
        signals = self._signals = self.window.snapshot(self.clock())
        decisions = self.planner.decide(signals)
        if self.planner.holding:
            log.debug("planner holds: %s", self.planner.holding)
        targets = [d for d in decisions if d.action is not Action.SET_ROLE]
        published = await self._publish_target(signals, targets) if targets else ""
        for decision in decisions:
            outcome = await self._carry_out(decision, published)
            log.info(
                "decision: %s %s%s (%s): %s -> %s", decision.action.name, decision.role,
                f" worker {decision.worker_id}" if decision.worker_id else "",
                decision.reason.name, decision.detail, outcome,
            )  # fmt: skip
            self.metrics.count(decision)
            self.recent.append(_reported(decision, self.clock(), outcome))
        self.metrics.want(self.wanted(signals))
        self.metrics.ttft_p99.set(signals.ttft_p99)
        self.metrics.tpot_p99.set(signals.tpot_p99)
        await self.bus.publish(self.subjects.planner_report, self.report())
        return decisions

    def wanted(self, signals: MeshSignals) -> RoleCounts:
        return self.desired if self.desired is not None else counts_after(signals, ())

    async def _carry_out(self, decision: Decision, published: str) -> str:
        """SetRole for SET_ROLE; ADD and DRAIN were carried out by the round's one target
        (`published` says which)."""
        with self.tracing.tracer.start_as_current_span("planner.decision") as span:
            span.set_attributes(
                {
                    "splitserve.planner.action": decision.action.name.lower(),
                    "splitserve.planner.reason": decision.reason.name.lower(),
                    "splitserve.planner.role": decision.role,
                    "splitserve.planner.worker_id": decision.worker_id,
                    "splitserve.planner.detail": decision.detail,
                }
            )
            if decision.action is Action.SET_ROLE:
                outcome = await self._set_role(decision, inject(span))
            else:
                outcome = published
            span.set_attribute("splitserve.planner.outcome", outcome)
            return outcome

    async def _set_role(self, decision: Decision, headers: Headers) -> str:
        subject = self.subjects.role(decision.worker_id)
        try:
            ack = await self.bus.request(
                subject, SetRole(decision.role), TaskAck, self.config.role_timeout, headers
            )
        except (NatsError, TimeoutError) as exc:
            self.planner.not_taken()
            return f"no answer: {type(exc).__name__}"
        if not ack.ok:
            self.planner.not_taken()
            return f"refused: {ack.outcome.name} {ack.error}".rstrip()
        return "ok"

    async def _publish_target(self, signals: MeshSignals, targets: list[Decision]) -> str:
        """The counts the mesh has, with the round's ADDs and DRAINs, become the planner's
        target: one whole PoolTarget for the round."""
        wanted = self.desired = counts_after(signals, targets)
        self._seq_no = self._next_seq()
        reason = ",".join(dict.fromkeys(d.reason.name.lower() for d in targets))
        target = PoolTarget(
            self.config.planner_id, self._seq_no, self.config.planner_model,
            wanted.prefill, wanted.decode, wanted.both, reason,
        )  # fmt: skip
        await self.bus.publish(self.subjects.pool_target, target)
        return f"target {self._seq_no} published: {wanted}"

    def report(self) -> PlannerReport:
        policy, signals = self.config.policy, self._signals
        wanted = self.wanted(signals)
        self._seq_no = self._next_seq()
        return PlannerReport(
            self.config.planner_id, self._seq_no, self.clock(), policy.mode,
            self.config.planner_model, policy.ttft_slo, policy.tpot_slo,
            wanted.prefill, wanted.decode, wanted.both, signals.ttft_p99, signals.tpot_p99,
            self.planner.holding, list(self.recent),
        )  # fmt: skip

    def _next_seq(self) -> int:
        return max(self._seq_no + 1, int(self.clock() * 1000))


def _reported(decision: Decision, now: float, outcome: str) -> ReportedDecision:
    return ReportedDecision(
        now, decision.action.name.lower(), decision.reason.name.lower(), decision.role,
        decision.worker_id, decision.detail, outcome,
    )  # fmt: skip
