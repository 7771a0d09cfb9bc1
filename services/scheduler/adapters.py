"""The scheduler's part in LoRA adapters: an `AdapterCommand` from a gateway goes to every
registered worker of its model at once, and the answer gathers theirs; `count_placement`
counts where adapter requests went (affinity: the adapter was in a slot; load: it was not).

The one rule: a worker that does not answer within `ADAPTER_TIMEOUT_S` counts as FAILED in
the report (the gateway says which), never as loaded; the command may be repeated, since a
worker loads a name again by reading it afresh.
"""

from __future__ import annotations

import asyncio

from nats.errors import Error as NatsError
from opentelemetry import trace

from services.scheduler.registry import Registry
from shared.bus import Bus, Headers
from shared.lora_messages import AdapterAnswer, AdapterCommand, AdapterReport
from shared.protocol import Outcome, SubmitAck, SubmitRequest
from shared.subjects import Subjects
from shared.telemetry.metrics import SchedulerMetrics
from shared.wire_codec import WireError

ADAPTER_TIMEOUT_S = 60.0  # reading and checking one adapter, on a loaded worker


class AdapterFanOut:
    def __init__(self, bus: Bus, registry: Registry, subjects: Subjects) -> None:
        self.bus = bus
        self.registry = registry
        self.subjects = subjects

    async def on_command(self, command: AdapterCommand, headers: Headers) -> AdapterReport:
        workers = [
            status.heartbeat.worker_id
            for status in self.registry.status()
            if command.model in ("", status.heartbeat.model)
        ]
        if not workers:
            of_model = f" of model {command.model!r}" if command.model else ""
            return AdapterReport(error=f"no worker{of_model} is registered")
        answers = await asyncio.gather(*(self._ask(worker, command) for worker in workers))
        return AdapterReport(list(answers))

    async def _ask(self, worker_id: str, command: AdapterCommand) -> AdapterAnswer:
        subject = self.subjects.worker_adapters(worker_id)
        try:
            return await self.bus.request(subject, command, AdapterAnswer, ADAPTER_TIMEOUT_S)
        except (TimeoutError, NatsError, WireError) as exc:
            return AdapterAnswer(worker_id, Outcome.FAILED, f"no answer: {exc!r}")


def refuse(reason: str) -> AdapterReport:
    return AdapterReport(error=reason)


def count_placement(
    registry: Registry, metrics: SchedulerMetrics, request: SubmitRequest, ack: SubmitAck
) -> None:
    """An accepted request of a LoRA adapter: per worker it went to, whether the adapter was
    in a slot there (affinity) or is loaded for it; that worker has it from now on."""
    adapter = request.sampling.adapter
    if not adapter or not ack.accepted:
        return
    for worker_id in {ack.prefill_worker, ack.decode_worker} - {""}:
        loaded = registry.place_adapter(worker_id, adapter)
        affinity = "loaded" if loaded else "load"
        metrics.adapter_placements.labels(request.model, adapter, affinity).inc()
        trace.get_current_span().set_attribute(f"splitserve.adapter_{affinity}", worker_id)
