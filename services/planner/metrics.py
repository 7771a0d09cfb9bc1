"""The planner's Prometheus metrics (served on `--metrics-port`, shared/telemetry/metrics.py).

`splitserve_planner_desired_replicas{model,role}` is what the Kubernetes manifests scale on
(compose/k8s/overlays/planner: a KEDA ScaledObject per worker Deployment);
`splitserve_planner_decisions_total{action,reason}` counts every decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.planner.counts import RoleCounts
from services.planner.decision import Decision
from shared.protocol import ROLES
from shared.telemetry.metrics import P


@dataclass(slots=True)
class PlannerMetrics:
    model: str  # the model label ("" : a mesh of one model)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    desired: Gauge = field(init=False)
    decisions: Counter = field(init=False)
    ttft_p99: Gauge = field(init=False)
    tpot_p99: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.desired = Gauge(
            P + "planner_desired_replicas", "Workers the planner wants of each role",
            ["model", "role"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            P + "planner_decisions", "Decisions the planner made, by action and reason",
            ["action", "reason"], registry=r,
        )  # fmt: skip
        self.ttft_p99 = Gauge(
            P + "planner_ttft_p99_seconds", "TTFT p99 over the planner's window (0: no sample)",
            registry=r,
        )  # fmt: skip
        self.tpot_p99 = Gauge(
            P + "planner_tpot_p99_seconds", "TPOT p99 over the planner's window (0: no sample)",
            registry=r,
        )  # fmt: skip

    def count(self, decision: Decision) -> None:
        self.decisions.labels(decision.action.name.lower(), decision.reason.name.lower()).inc()

    def want(self, counts: RoleCounts) -> None:
        for role in ROLES:
            self.desired.labels(self.model, role).set(counts.of(role))
