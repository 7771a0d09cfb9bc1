"""Traffic colouring in traces: the `x-splitserve-traffic` class becomes an attribute of the
gateway's span and of every span after it, across processes (NATS headers) and within one."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.telemetry.tracing import (
    TRAFFIC,
    extract,
    inject,
    traffic_class,
    traffic_processor,
)


def tracer_and_spans() -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(traffic_processor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_the_traffic_class_reaches_every_span_of_the_request():
    tracer, exporter = tracer_and_spans()
    http_headers = {"x-splitserve-traffic": "canary", "content-type": "application/json"}
    with tracer.start_as_current_span("gateway.request", extract(http_headers)) as gateway:
        nats_headers = inject(gateway)  # gateway -> scheduler
    assert "canary" in nats_headers["baggage"]
    route = tracer.start_span("scheduler.route", extract(nats_headers))
    worker_headers = inject(route)  # scheduler -> worker
    route.end()
    send = tracer.start_span("kv.transfer", extract(worker_headers))
    # Within one process, a span whose parent is a recorded span (not baggage) gets it too.
    generate = tracer.start_span("decode.generate", trace.set_span_in_context(send))
    generate.end()
    send.end()
    other = tracer.start_span("gateway.request", extract({"content-type": "x"}))
    other.end()
    traffic = [(s.name, s.attributes.get(TRAFFIC)) for s in exporter.get_finished_spans()]
    assert traffic == [
        ("gateway.request", "canary"),
        ("scheduler.route", "canary"),
        ("decode.generate", "canary"),
        ("kv.transfer", "canary"),
        ("gateway.request", None),
    ]


def test_a_span_under_a_parent_that_ended_gets_the_class_too():
    """`scheduler.prefix_hit` starts under the route span after that span ended (when the
    worker reports its first token)."""
    tracer, exporter = tracer_and_spans()
    route = tracer.start_span("scheduler.route", extract({"x-splitserve-traffic": "canary"}))
    route.end()
    tracer.start_span("scheduler.prefix_hit", trace.set_span_in_context(route)).end()
    traffic = [(s.name, s.attributes.get(TRAFFIC)) for s in exporter.get_finished_spans()]
    assert traffic == [("scheduler.route", "canary"), ("scheduler.prefix_hit", "canary")]


def test_only_plain_names_are_traffic_classes():
    assert traffic_class("canary-2.b_x") == "canary-2.b_x"
    for bad in ("", "a b", "x" * 65, "évil", "a,b"):
        assert traffic_class(bad) == ""
