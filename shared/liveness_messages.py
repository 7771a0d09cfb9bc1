"""The scheduler's liveness probe: asked when a worker's heartbeats stop, before it is
declared lost (services/scheduler/liveness.py).

A worker answers a `Probe` on `<ns>.worker.<id>.probe` from its event loop with a
`ProbeAck` naming its process epoch (shared/epoch.py). The subtle rule: an answer counts
only when its epoch is the one registered under that id — a restarted process answering
for the old one proves the old one gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import Outcome


@dataclass(slots=True)
class Probe:
    worker_id: str  # the worker asked
    epoch: int  # the process the scheduler has registered under that id (0: any)


@dataclass(slots=True)
class ProbeAck:
    worker_id: str
    epoch: int  # the answering process's
    outcome: Outcome = Outcome.OK  # INVALID: the probe did not decode
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK
