"""Every NATS subject, built in one place under a namespace (default `ss`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_NAMESPACE = "ss"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def _check(token: str, what: str) -> str:
    if not _TOKEN.match(token):
        raise ValueError(f"{what} {token!r} must be letters, digits, '_' or '-'")
    return token


@dataclass(frozen=True, slots=True)
class Subjects:
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        _check(self.namespace, "namespace")

    @property
    def submit(self) -> str:  # gateway → scheduler, request/reply, queue group "schedulers"
        return f"{self.namespace}.sched.submit"

    @property
    def status(self) -> str:  # anyone → scheduler, request/reply
        return f"{self.namespace}.sched.status"

    @property
    def adapters(self) -> str:  # gateway → scheduler, request/reply: AdapterCommand
        return f"{self.namespace}.sched.adapters"

    @property
    def heartbeat(self) -> str:  # worker → scheduler
        return f"{self.namespace}.workers.heartbeat"

    @property
    def kv_events(self) -> str:  # worker → scheduler
        return f"{self.namespace}.kv.events"

    @property
    def cancel(self) -> str:  # gateway/scheduler → all workers
        return f"{self.namespace}.cancel"

    @property
    def events(self) -> str:  # scheduler → gateways: WorkerLost, RequestFailed
        return f"{self.namespace}.events"

    @property
    def pool_target(self) -> str:  # planner, `splitserve scale` → launcher: PoolTarget
        return f"{self.namespace}.pool.target"

    @property
    def planner_report(self) -> str:  # planner → scheduler (its status, /mesh)
        return f"{self.namespace}.planner.report"

    def reserve(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.reserve"

    def prefill(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.prefill"

    def decode(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.decode"

    def role(self, worker_id: str) -> str:  # scheduler (planner, admin) → worker: SetRole
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.role"

    def worker_adapters(self, worker_id: str) -> str:  # scheduler → worker: AdapterCommand
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.adapters"

    def probe(self, worker_id: str) -> str:  # scheduler → worker: Probe (is it alive?)
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.probe"

    def sleep(self, worker_id: str) -> str:  # gateway → worker: SleepCommand → SleepReply
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.sleep"

    def prefix(self, worker_id: str) -> str:  # worker → worker: PrefixPin (prefix_messages.py)
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.prefix"

    def kv(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{_check(worker_id, 'worker id')}.kv"

    def tokens(self, gateway_id: str) -> str:
        return f"{self.namespace}.gateway.{_check(gateway_id, 'gateway id')}.tokens"


SCHEDULER_QUEUE_GROUP = "schedulers"
