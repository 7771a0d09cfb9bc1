"""What the planner decides: one `Decision` per action, each with its reason.

The subtle rule: a decision names a worker for SET_ROLE and DRAIN (the planner picks which)
and a role for ADD (whoever acts picks the process: `up` starts one, k8s scales the
Deployment); the actor, not the planner, finds out whether it took effect, from the next
snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Action(IntEnum):
    SET_ROLE = 1  # worker_id serves `role` from now on
    ADD = 2  # one more worker of `role`
    DRAIN = 3  # worker_id finishes what it holds and leaves


class Reason(IntEnum):
    TTFT_OVER_SLO = 1  # first tokens late: more prefill capacity
    TPOT_OVER_SLO = 2  # streams slow: more decode capacity
    PREFILL_QUEUE = 3  # prompt tokens queue faster than the prefill side computes them
    KV_FULL = 4  # decode KV pools nearly full
    PREFILL_IDLE = 5  # prefill side mostly idle while objectives are met
    DECODE_IDLE = 6  # decode side mostly idle while objectives are met
    NO_SIGNAL = 7  # nothing measured yet: keep the configuration
    PREFILL_DEMAND = 8  # the prompt work in flight wants more prefill workers (demand.py)
    DECODE_DEMAND = 9  # the streams in flight want more decode workers (demand.py)


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: Reason
    role: str  # SET_ROLE: the new role; ADD: the new worker's; DRAIN: the worker's role
    worker_id: str = ""  # SET_ROLE and DRAIN
    detail: str = ""  # the figures behind it, for the log and /mesh
