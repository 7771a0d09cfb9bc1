"""Sleep and wake-up of a worker (vLLM's /sleep and /wake_up, through the gateway): the
gateway's command on `ss.worker.<id>.sleep` and the worker's reply.

A sleeping worker serves nothing: it drained (or failed, so that its gateways migrate them)
the requests it held, left the scheduler's candidates (its heartbeats carry its level),
and gave back its KV pool (level 1) and its weights too (level 2). `SleepLevel.AWAKE` as a
command wakes it up. The subtle rule: the reply comes once the level is reached, so a
gateway that answers 200 has a worker that holds nothing and will get nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import Outcome
from shared.sleep_level import SleepLevel


@dataclass(slots=True)
class SleepCommand:
    level: SleepLevel  # AWAKE: wake up
    drain_timeout: float = 30.0  # seconds its requests may take to finish before it sleeps


@dataclass(slots=True)
class SleepReply:
    worker_id: str
    level: SleepLevel  # the level it is at now
    outcome: Outcome = Outcome.OK  # INVALID: a bad command; UNAVAILABLE: not carried out
    error: str = ""  # why not, when not OK

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK
