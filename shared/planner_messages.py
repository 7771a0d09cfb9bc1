"""The planner's report: what it aims at and what it decided lately, for the mesh view.

The planner (services/planner/service.py) publishes a `PlannerReport` on
`<ns>.planner.report` after every decision round; the scheduler keeps the newest and returns
it in `MeshStatus.planner`, which the gateway's /mesh page shows. The subtle rule: the report
is a whole state (the objectives, the counts wanted, the last `MAX_REPORTED` decisions), so
a receiver keeps the newest `seq_no` and a lost one costs nothing. Actions and reasons travel
as the lower-case names of services/planner/decision.py's enums: shared/ cannot import them,
and the report is for people to read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_REPORTED = 20  # decisions a report carries, newest last


@dataclass(slots=True)
class ReportedDecision:
    time: float  # Unix seconds, when it was decided
    action: str  # "set_role" | "add" | "drain"
    reason: str  # "ttft_over_slo", "tpot_over_slo", "prefill_queue", "kv_full", ...
    role: str  # SET_ROLE: the new role; ADD: the new worker's; DRAIN: the worker's
    worker_id: str = ""  # SET_ROLE and DRAIN
    detail: str = ""  # the figures behind it
    outcome: str = ""  # what came of it: "ok", a worker's refusal, "target N published"


@dataclass(slots=True)
class PlannerReport:
    planner_id: str
    seq_no: int  # +1 each report; an older one is ignored
    time: float  # Unix seconds
    mode: str  # "roles" | "replicas"
    model: str  # the model it plans ("": a mesh of one model)
    ttft_slo: float  # the objectives, seconds at p99
    tpot_slo: float
    prefill: int  # workers it wants of each role
    decode: int
    both: int
    ttft_p99: float = 0.0  # the last snapshot's figures (0: no sample)
    tpot_p99: float = 0.0
    holding: str = ""  # why the last round decided nothing ("" when it decided)
    decisions: list[ReportedDecision] = field(default_factory=list)  # newest last
