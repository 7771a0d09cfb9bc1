"""Tracer setup and W3C trace-context propagation over NATS headers.

Span names (DESIGN.md section 7): gateway.request → scheduler.route → prefill.queue,
prefill.compute, kv.transfer (send) → kv.transfer (receive) → decode.queue, decode.generate.
Spans of the engine thread are recorded from the event loop with explicit start and end
times (`ns`).

Traffic colouring: a request's traffic class (the HTTP header `x-splitserve-traffic`, e.g.
"canary") travels as W3C baggage `splitserve.traffic` beside the `traceparent`, and every
span whose parent carries it (as baggage, or as the parent span's own attribute) gets the
span attribute `splitserve.traffic`; `inject` passes it on from the span it injects.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import NoOpTracer, Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:  # the SDK loads only when spans are exported
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
Headers = dict[str, str]
TRAFFIC_HEADER = "x-splitserve-traffic"  # the client's traffic class, on the HTTP request
TRAFFIC = "splitserve.traffic"  # its baggage key and span attribute
TRAFFIC_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a class name (a metrics label value)


@dataclass(slots=True)
class Tracing:
    tracer: Tracer
    provider: TracerProvider | None = None  # None: no endpoint, nothing recorded or sent

    def shutdown(self) -> None:
        """Flush spans not yet exported (bounded by the exporter's timeout)."""
        if self.provider is not None:
            self.provider.shutdown()


def otlp_endpoint(flag: str = "") -> str:
    """The flag's endpoint, else `OTEL_EXPORTER_OTLP_ENDPOINT`, else "" (no export)."""
    return flag or os.environ.get(ENDPOINT_ENV, "")


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's signal path under a base endpoint, as the OTel spec builds it."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


def setup_tracing(service: str, endpoint: str, instance: str = "") -> Tracing:
    """A tracer for `service` ("gateway", "scheduler", "prefill", "decode", "worker")."""
    if not endpoint:
        return Tracing(NoOpTracer())
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": f"splitserve-{service}"}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(traffic_processor())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    return Tracing(provider.get_tracer("splitserve"), provider)


def inject(span: Span) -> Headers:
    """NATS headers carrying `span` as the parent of the receiver's spans ({} if none)."""
    headers: Headers = {}
    if span.get_span_context().is_valid:
        context = trace.set_span_in_context(span)
        traffic = _span_traffic(span)
        if traffic:
            context = baggage.set_baggage(TRAFFIC, traffic, context)
        _PROPAGATOR.inject(headers, context)
    return headers


def extract(headers: Headers) -> Context:
    """The parent context a message's (or HTTP request's) `traceparent` names, with the
    traffic class of its baggage, or of an HTTP request's `x-splitserve-traffic` header."""
    context = _PROPAGATOR.extract(headers)
    traffic = traffic_class(headers.get(TRAFFIC_HEADER, ""))
    return baggage.set_baggage(TRAFFIC, traffic, context) if traffic else context


def traffic_class(value: str) -> str:
    """`value` when it is a valid traffic class name, else "" (none)."""
    return value if TRAFFIC_PATTERN.fullmatch(value) else ""


def _span_traffic(span: Span) -> str:
    """The traffic attribute of a recorded span, ended or not ("" for a non-recording one:
    a span that ended still parents later ones, e.g. `scheduler.prefix_hit` under the route)."""
    if isinstance(span, trace.NonRecordingSpan):  # no SDK span (nothing is exported)
        return ""
    from opentelemetry.sdk.trace import ReadableSpan

    if isinstance(span, ReadableSpan) and span.attributes:
        return str(span.attributes.get(TRAFFIC, ""))
    return ""


def traffic_processor() -> SpanProcessor:
    """A span processor that sets `splitserve.traffic` on a span from its parent context."""
    from opentelemetry.sdk.trace import SpanProcessor

    class TrafficAttribute(SpanProcessor):
        def on_start(self, span: Span, parent_context: Context | None = None) -> None:
            traffic = baggage.get_baggage(TRAFFIC, parent_context) or _span_traffic(
                trace.get_current_span(parent_context)
            )
            if traffic:
                span.set_attribute(TRAFFIC, str(traffic))

    return TrafficAttribute()


def fail(span: Span, error: str | BaseException) -> None:
    """Mark `span` failed: status ERROR with the reason, plus the exception event if any."""
    if isinstance(error, BaseException):
        span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))


def ns(unix_seconds: float | None = None) -> int:
    """A span timestamp: nanoseconds since the epoch (now when not given)."""
    return time.time_ns() if unix_seconds is None else int(unix_seconds * 1e9)
