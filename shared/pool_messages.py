"""The pool plane's wire messages: how many workers of each role are wanted, and why.

The planner (services/planner/) or `splitserve scale` publishes a `PoolTarget` on
`<ns>.pool.target`; `splitserve up` starts or drains worker processes to match it, and
on k8s the planner's `splitserve_planner_desired_replicas{model,role}` metric carries the
same counts for the manifests to scale on. The subtle rule: a target is a whole state, not
a change: a receiver keeps only the newest `seq_no` per publisher, so a lost or repeated
message never adds or drains a worker twice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolTarget:
    publisher: str  # who decided: a planner's id, or "scale" (the command)
    seq_no: int  # per publisher, +1 each target; an older one is ignored
    model: str  # the served model's name ("" when the mesh serves one)
    prefill: int  # workers wanted of each role
    decode: int
    both: int
    reason: str = ""  # the decision's reason, for logs and /mesh

    def wanted(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode, "both": self.both}[role]
