"""The LoRA plane's wire messages: load or unload an adapter on every worker of a model.

The gateway (vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`) asks the
scheduler on `<ns>.sched.adapters` with an `AdapterCommand`; the scheduler sends the same
command to each registered worker of the model on `<ns>.worker.<id>.adapters` and answers
with an `AdapterReport` of every worker's `AdapterAnswer`. The subtle rule: the command is
idempotent per worker (loading a name again reads it afresh), so a gateway may repeat one
that partly failed, and a worker that joins later learns its adapters from its own
`--lora-modules`, not from past commands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from shared.protocol import Outcome


class AdapterAction(IntEnum):
    LOAD = 0
    UNLOAD = 1


@dataclass(slots=True)
class AdapterCommand:
    action: AdapterAction
    name: str  # the adapter's name, as requests' `model` names it
    path: str = ""  # LOAD: the PEFT directory, as each worker's filesystem sees it
    model: str = ""  # the base model whose workers load it ("": every worker)


@dataclass(slots=True)
class AdapterAnswer:
    worker_id: str
    outcome: Outcome  # OK, or INVALID with the worker's reason
    error: str = ""


@dataclass(slots=True)
class AdapterReport:
    answers: list[AdapterAnswer] = field(default_factory=list)
    error: str = ""  # the scheduler's own refusal (no worker of the model)

    @property
    def ok(self) -> bool:
        return not self.error and all(a.outcome == Outcome.OK for a in self.answers)

    def reasons(self) -> str:
        """Why not, one line: the scheduler's error or each failing worker's."""
        failed = [f"{a.worker_id}: {a.error}" for a in self.answers if a.outcome != Outcome.OK]
        return self.error or "; ".join(failed)
