"""A worker's spans and metrics: calls at the engine's reported transitions (`on_started`,
`on_first_token`, `on_output`), hooks on the request table's own moves and ends
(requests.py), and the engine's counters at every heartbeat (`on_stats`).

Spans of work the engine thread did are recorded with explicit times:
  prefill: from its acceptance to the step that started it (`started`) `prefill.queue`; from
    that step to its first token `prefill.compute`; TRANSFERRING: the sending `kv.transfer`
    (made by the hand-off itself, which needs its context for the chunks' headers).
  decode: RECEIVING (its receiver's first bytes) → ENGINE (every block in) the receiving
    `kv.transfer`, parent of the rest; from entering ENGINE to its first step
    `decode.queue`; from that step to the end `decode.generate`.
Everything per request lives in its `Trace` (`first_step` is the one phase the spans keep:
0 until the engine's first step of it); this object keeps no per-request state.

For the scheduler's path choice it also keeps what the next heartbeat carries: the TTFT of
each first token this worker streamed (a prefill's, or a `DecodeTask`'s own), measured from
the gateway's `submitted_at` (clocks of one mesh are assumed in step; negative is clamped to
0), and the share of each interval spent in steps. For the planner, the TPOT of each stream
that ended well here (stop or length): from its first tokens streamed here to its end, over
the tokens after the first (on a split request that leaves out the gap between the prefill
worker's first token and decode's first, which the KV transfer fills).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from prometheus_client import Counter

from services.worker.config import WorkerConfig
from services.worker.requests import RECEIVES, RequestState, WorkerRequest
from services.worker.step_costs import BusyShare
from services.worker.tier_metrics import TierMetrics
from shared.engine.outputs import RequestOutput
from shared.engine.spec_decode import SpecDecodeStats
from shared.engine.stats import EngineStats
from shared.protocol import FirstToken
from shared.telemetry.metrics import WorkerMetrics
from shared.telemetry.tracing import Tracing, fail, ns, setup_tracing

S = RequestState
MAX_FIRST_TOKENS = 4096  # kept for the next heartbeat; beyond, the newest are not reported


@dataclass(slots=True)
class WorkerTelemetry:
    config: WorkerConfig
    tracing: Tracing = field(init=False)
    metrics: WorkerMetrics = field(init=False)
    _prefix_counted: tuple[int, int] = (0, 0)  # (queries, hits) already added to the counters
    _spec_counted: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # already added
    _preemptions_counted: int = 0  # already added to the counter
    # this role's child of the sampled-token counter, looked up once: `on_output` runs for
    # every request of every step, on the loop the engine thread waits on for the GIL
    _sampled: Counter = field(init=False)
    _first_tokens: list[FirstToken] = field(default_factory=list)  # since the last heartbeat
    _busy: BusyShare = field(default_factory=BusyShare)
    _stream_tpots: list[float] = field(default_factory=list)  # since the last heartbeat
    tier_metrics: TierMetrics = field(init=False)  # the second KV tier's, read at each scrape

    def __post_init__(self) -> None:
        role = self.config.role
        service = "worker" if role == "both" else role
        self.tracing = setup_tracing(
            service, self.config.common.otlp_endpoint, self.config.worker_id
        )
        self.metrics = WorkerMetrics(role, self.config.model_name)
        self._sampled = self.metrics.generation_tokens.labels(role)
        self.tier_metrics = TierMetrics(role, self.config.model_name)
        self.metrics.registry.register(self.tier_metrics)

    @property
    def tracer(self) -> trace.Tracer:
        return self.tracing.tracer

    def on_stats(self, stats: EngineStats) -> None:
        """The engine's counters (each heartbeat): gauges set, counters moved by the delta."""
        metrics, role = self.metrics, self.config.role
        metrics.running.labels(role).set(stats.num_running)
        metrics.waiting.labels(role).set(stats.num_waiting)
        metrics.kv_usage.labels(role).set(stats.usage)
        queries, hits = self._prefix_counted
        metrics.prefix_queries.labels(role).inc(stats.prefix_queries - queries)
        metrics.prefix_hits.labels(role).inc(stats.prefix_hits - hits)
        self._prefix_counted = (stats.prefix_queries, stats.prefix_hits)
        metrics.preemptions.labels(role).inc(stats.num_preemptions - self._preemptions_counted)
        self._preemptions_counted = stats.num_preemptions
        spec, counted = stats.spec_decode, self._spec_counted
        metrics.spec_proposed.labels(role).inc(spec.proposed - counted.proposed)
        metrics.spec_accepted.labels(role).inc(spec.accepted - counted.accepted)
        metrics.spec_verify_steps.labels(role).inc(spec.verify_steps - counted.verify_steps)
        metrics.spec_acceptance.labels(role).set(spec.acceptance_rate)
        self._spec_counted = replace(spec)
        self.tier_metrics.update(stats.tier)

    def busy_share(self, stats: EngineStats, now: float) -> float:
        """The share of the time since the last call the engine spent in steps."""
        return self._busy.share(stats.costs.busy_seconds, now)

    def take_first_tokens(self) -> list[FirstToken]:
        """The first tokens streamed since the last call (the heartbeat carries them)."""
        taken, self._first_tokens = self._first_tokens, []
        return taken

    def take_stream_tpots(self) -> list[float]:
        """The TPOT of each stream ended since the last call (the heartbeat carries them)."""
        taken, self._stream_tpots = self._stream_tpots, []
        return taken

    # -- the engine's transitions (Worker.on_step) ------------------------------------------
    def on_started(self, request: WorkerRequest, step_started: float) -> None:
        """The engine's first step of the request (reported started, or a decode's first
        tokens once its KV is in) ends its queue span; later reports change nothing."""
        record = request.trace
        if record.first_step:
            return
        record.first_step = max(record.entered, step_started)
        name = "decode.queue" if request.decodes else "prefill.queue"
        self._queue_span(name, request, record.first_step)

    def on_first_token(self, request: WorkerRequest, output: RequestOutput, now: float) -> None:
        """A prefill's first token: its compute span, from the step that started it."""
        span = self._span("prefill.compute", request, request.trace.first_step)
        span.set_attributes(
            {
                "splitserve.prompt_tokens": len(request.request.prompt_token_ids),
                "splitserve.cached_tokens": output.num_cached_tokens,
            }
        )
        span.end(ns(now))
        self._first_token(request, now, output.num_cached_tokens)

    def on_output(self, request: WorkerRequest, output: RequestOutput, step_started: float) -> None:
        self._sampled.inc(len(output.new_token_ids))
        if not request.decodes:
            return
        self.on_started(request, step_started)  # the first step after KVDone
        if not request.trace.tokens:
            request.trace.first_output = time.time()
            if not request.num_blocks:  # a DecodeTask's first token
                self._first_token(request, request.trace.first_output, output.num_cached_tokens)
        request.trace.tokens += len(output.new_token_ids)
        request.trace.steps += 1

    # -- hooks of the request table -------------------------------------------------------
    def on_move(self, request: WorkerRequest, old: RequestState, now: float) -> None:
        if old in RECEIVES and request.state == S.ENGINE:  # the receiver has every block
            started = request.trace.entered if old == S.RECEIVING else now
            self._receive_span(request, started, now, "")

    def on_end(self, request: WorkerRequest, reason: str, now: float) -> None:
        if request.state == S.RECEIVING and reason != "cancelled":
            self._receive_span(request, request.trace.entered, now, reason)
        if request.decodes and request.trace.first_step:
            span = self._span("decode.generate", request, request.trace.first_step)
            span.set_attributes(
                {
                    "splitserve.tokens": request.trace.tokens,
                    "splitserve.steps": request.trace.steps,
                    "splitserve.finish_reason": reason,
                }
            )
            if reason not in ("stop", "length"):
                fail(span, reason)
            else:
                self._stream_tpot(request, now)
            span.end(ns(now))

    # -- the sending side of a KV transfer -------------------------------------------------
    def start_send(self, request: WorkerRequest, blocks: int, num_bytes: int) -> Span:
        span = self.tracer.start_span("kv.transfer", request.trace.parent, kind=SpanKind.PRODUCER)
        span.set_attributes(_transfer_attributes(request, "send", blocks, num_bytes))
        return span

    def end_send(
        self, request: WorkerRequest, span: Span, seconds: float, num_bytes: int, error: str = ""
    ) -> None:
        self._account(request, "send", seconds, num_bytes, error)
        if error:
            fail(span, error)
        span.set_attribute("splitserve.kv.seconds", seconds)
        span.end()

    # -- internals --------------------------------------------------------------------------
    def _first_token(self, request: WorkerRequest, now: float, cached_tokens: int) -> None:
        submitted = request.request.submitted_at
        if submitted > 0 and len(self._first_tokens) < MAX_FIRST_TOKENS:
            ttft = max(0.0, now - submitted)
            self._first_tokens.append(FirstToken(request.request_id, ttft, cached_tokens))

    def _stream_tpot(self, request: WorkerRequest, now: float) -> None:
        record = request.trace
        if (
            record.tokens >= 2
            and record.first_output
            and len(self._stream_tpots) < MAX_FIRST_TOKENS
        ):
            self._stream_tpots.append(max(0.0, now - record.first_output) / (record.tokens - 1))

    def _span(self, name: str, request: WorkerRequest, start: float) -> Span:
        span = self.tracer.start_span(name, request.trace.parent, start_time=ns(start))
        span.set_attribute("splitserve.request_id", request.request_id)
        return span

    def _queue_span(self, name: str, request: WorkerRequest, end: float) -> None:
        start = min(request.trace.entered, end)
        self.metrics.queue_time.labels(self.config.role).observe(end - start)
        self._span(name, request, start).end(ns(end))

    def _receive_span(self, request: WorkerRequest, started: float, now: float, error: str):
        """From the first chunk (`started`; now, when no block was sent) to KVDone or the
        failure; on success its context becomes the parent of the decode spans."""
        record = request.trace
        span = self.tracer.start_span(
            "kv.transfer", record.parent, kind=SpanKind.CONSUMER, start_time=ns(started)
        )
        attributes = _transfer_attributes(request, "receive", record.kv_blocks, record.kv_bytes)
        span.set_attributes(attributes | {"splitserve.kv.seconds": now - started})
        self._account(request, "receive", now - started, record.kv_bytes, error)
        if error:
            fail(span, error)
        span.end(ns(now))
        record.parent = trace.set_span_in_context(span)

    def _account(
        self, request: WorkerRequest, direction: str, seconds: float, num_bytes: int, error: str
    ) -> None:
        labels = (self.config.role, direction, request.transport)
        if error:
            self.metrics.transfer_failures.labels(*labels).inc()
            return
        self.metrics.transfer_seconds.labels(*labels).observe(seconds)
        self.metrics.transfer_bytes.labels(*labels).inc(num_bytes)


def _transfer_attributes(request: WorkerRequest, direction: str, blocks: int, num_bytes: int):
    return {
        "splitserve.request_id": request.request_id,
        "splitserve.kv.direction": direction,
        "splitserve.kv.blocks": blocks,
        "splitserve.kv.bytes": num_bytes,
        "splitserve.kv.transport": request.transport,
    }
