"""A worker's spans and metrics, kept beside the request flow of prefill.py and decode.py.

Spans the engine thread's work covers are recorded on the event loop with explicit times:
a task arrives (`queued`) → the engine step that produced its first output started
(`*.queue` ends, `prefill.compute` / `decode.generate` begin) → the request's last output.
For a prompt chunked over several steps, `prefill.compute` starts with the step of its
last chunk (the engine reports no earlier per-request times). KV transfers get a
`kv.transfer` span on each side; the receiving one is the parent of decode's spans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from services.worker.config import WorkerConfig
from shared.engine.outputs import RequestOutput
from shared.telemetry.metrics import WorkerMetrics
from shared.telemetry.tracing import Headers, Tracing, extract, fail, ns, setup_tracing

TRANSPORT = "nats"


@dataclass(slots=True)
class Queued:
    stage: str  # "prefill" | "decode"
    parent: Context
    arrived: float  # Unix seconds


@dataclass(slots=True)
class Generating:
    parent: Context
    started: float  # Unix seconds: start of the step that produced the first token
    tokens: int = 0
    steps: int = 0


@dataclass(slots=True)
class Receiving:
    started: float  # Unix seconds of the first chunk
    blocks: int = 0
    bytes: int = 0


@dataclass(slots=True)
class WorkerTelemetry:
    config: WorkerConfig
    tracing: Tracing = field(init=False)
    metrics: WorkerMetrics = field(init=False)
    queued: dict[str, Queued] = field(default_factory=dict)
    generating: dict[str, Generating] = field(default_factory=dict)
    receiving: dict[str, Receiving] = field(default_factory=dict)
    after_prefill: dict[str, Context] = field(default_factory=dict)  # parent of kv.transfer

    def __post_init__(self) -> None:
        role = self.config.role
        service = "worker" if role == "both" else role
        self.tracing = setup_tracing(service, self.config.otlp_endpoint, self.config.worker_id)
        self.metrics = WorkerMetrics(role)

    @property
    def tracer(self) -> trace.Tracer:
        return self.tracing.tracer

    def queue(self, request_id: str, stage: str, parent: Headers | Context) -> None:
        context = parent if isinstance(parent, Context) else extract(parent)  # Context is a dict
        self.queued[request_id] = Queued(stage, context, time.time())

    def on_output(self, output: RequestOutput, step_started: float) -> None:
        """Account one engine output of a queued or generating request."""
        rid, now = output.request_id, time.time()
        self.metrics.generation_tokens.labels(self.config.role).inc(len(output.new_token_ids))
        queued = self.queued.pop(rid, None)
        if queued is not None:
            self._end_queue(rid, queued, output, step_started, now)
        generating = self.generating.get(rid)
        if generating is None:
            return
        generating.tokens += len(output.new_token_ids)
        generating.steps += 1
        if output.finish_reason is not None:
            self._end_generate(rid, now, output.finish_reason.name.lower())

    def forget(self, request_id: str) -> None:
        """A cancelled request: close its open span, drop the rest."""
        self.queued.pop(request_id, None)
        self.receiving.pop(request_id, None)
        self.after_prefill.pop(request_id, None)
        if request_id in self.generating:
            self._end_generate(request_id, time.time(), "cancelled")

    def _end_queue(
        self, rid: str, queued: Queued, output: RequestOutput, step_started: float, now: float
    ) -> None:
        start = max(queued.arrived, min(step_started, now))
        self.metrics.queue_time.labels(self.config.role).observe(start - queued.arrived)
        span = self.tracer.start_span(
            f"{queued.stage}.queue", queued.parent, start_time=ns(queued.arrived)
        )
        span.set_attribute("splitserve.request_id", rid)
        span.end(ns(start))
        if queued.stage == "decode":
            self.generating[rid] = Generating(queued.parent, start)
            return
        span = self.tracer.start_span("prefill.compute", queued.parent, start_time=ns(start))
        span.set_attributes(
            {
                "splitserve.request_id": rid,
                "splitserve.prompt_tokens": output.num_prompt_tokens,
                "splitserve.cached_tokens": output.num_cached_tokens,
            }
        )
        span.end(ns(now))
        self.after_prefill[rid] = queued.parent

    def _end_generate(self, rid: str, now: float, finish_reason: str) -> None:
        generating = self.generating.pop(rid)
        span = self.tracer.start_span(
            "decode.generate", generating.parent, start_time=ns(generating.started)
        )
        span.set_attributes(
            {
                "splitserve.request_id": rid,
                "splitserve.tokens": generating.tokens,
                "splitserve.steps": generating.steps,
                "splitserve.finish_reason": finish_reason,
            }
        )
        if finish_reason == "abort":
            fail(span, "aborted by the engine")
        span.end(ns(now))

    # -- KV transfer --------------------------------------------------------------------
    def start_send(self, request_id: str, blocks: int, num_bytes: int) -> Span:
        span = self.tracer.start_span(
            "kv.transfer", self.after_prefill.pop(request_id, None), kind=SpanKind.PRODUCER
        )
        span.set_attributes(_transfer_attributes(request_id, "send", blocks, num_bytes))
        return span

    def end_send(self, span: Span, seconds: float, num_bytes: int, error: str = "") -> None:
        self._account("send", seconds, num_bytes, error)
        if error:
            fail(span, error)
        span.set_attribute("splitserve.kv.seconds", seconds)
        span.end()

    def on_chunk(self, request_id: str, blocks: int, num_bytes: int) -> None:
        receiving = self.receiving.setdefault(request_id, Receiving(time.time()))
        receiving.blocks += blocks
        receiving.bytes += num_bytes

    def on_done(self, request_id: str, headers: Headers, error: str = "") -> None:
        """KVDone arrived: record the receiving side's span; decode queues under it."""
        now = time.time()
        receiving = self.receiving.pop(request_id, None) or Receiving(now)
        span = self.tracer.start_span(
            "kv.transfer",
            extract(headers),
            kind=SpanKind.CONSUMER,
            start_time=ns(receiving.started),
        )
        attributes = _transfer_attributes(request_id, "receive", receiving.blocks, receiving.bytes)
        span.set_attributes(attributes | {"splitserve.kv.seconds": now - receiving.started})
        self._account("receive", now - receiving.started, receiving.bytes, error)
        if error:
            fail(span, error)
        span.end(ns(now))
        if not error:
            self.queue(request_id, "decode", trace.set_span_in_context(span))

    def _account(self, direction: str, seconds: float, num_bytes: int, error: str) -> None:
        labels = (self.config.role, direction)
        if error:
            self.metrics.transfer_failures.labels(*labels).inc()
            return
        self.metrics.transfer_seconds.labels(*labels).observe(seconds)
        self.metrics.transfer_bytes.labels(*labels).inc(num_bytes)


def _transfer_attributes(request_id: str, direction: str, blocks: int, num_bytes: int) -> dict:
    return {
        "splitserve.request_id": request_id,
        "splitserve.kv.direction": direction,
        "splitserve.kv.blocks": blocks,
        "splitserve.kv.bytes": num_bytes,
        "splitserve.kv.transport": TRANSPORT,
    }
