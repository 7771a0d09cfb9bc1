"""Prometheus metrics, named after vLLM's set with the prefix `splitserve_`.

Each service builds its own metrics in its own `CollectorRegistry` (several services can
share a process in tests). The gateway serves `/metrics` on its HTTP port; workers and the
scheduler call `serve_metrics` for a small HTTP server on `--metrics-port` (0 = a free one),
which also answers `/health` and `/ready` for probes.
Latency buckets run from 1 ms to 80 s, so CPU and GPU deployments both land mid-range.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# A prediction's error (observed − predicted) is signed: the same spans either side of 0.
ERROR_BUCKETS = (
    *(-b for b in reversed(LATENCY_BUCKETS[:-3])), 0.0, *LATENCY_BUCKETS[:-3],
)  # fmt: skip
P = "splitserve_"


@dataclass(slots=True)
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    ttft: Histogram = field(init=False)
    itl: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    requests: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    generation_tokens: Counter = field(init=False)
    running: Gauge = field(init=False)
    migrations: Counter = field(init=False)
    http_requests: Counter = field(init=False)
    http_duration: Histogram = field(init=False)
    fallbacks: Counter = field(init=False)
    scheduler_waits: Histogram = field(init=False)
    lora_requests: Counter = field(init=False)
    lora_tokens: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        # By the model that served (or last refused), the route called ("": a model by name)
        # and the traffic class of the request (`x-splitserve-traffic`; "": none).
        routed = ["model", "route", "traffic"]
        self.http_requests = Counter(
            P + "gateway_requests", "Generation requests answered, by model, route, traffic "
            "and HTTP status", [*routed, "status"], registry=r,
        )  # fmt: skip
        self.http_duration = Histogram(
            P + "gateway_request_duration_seconds", "Arrival to the end of the answer (or "
            "stream)", routed, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            P + "gateway_fallbacks", "Requests a model could not serve that went on down its "
            "fallback chain, by that model and the status it answered",
            ["model", "status", "traffic"], registry=r,
        )  # fmt: skip
        self.lora_requests = Counter(
            P + "lora_requests", "Generation requests (each choice) of a LoRA adapter",
            ["adapter"], registry=r,
        )  # fmt: skip
        self.lora_tokens = Counter(
            P + "lora_tokens", "Tokens of LoRA adapters' requests, by kind (prompt, generation)",
            ["adapter", "kind"], registry=r,
        )  # fmt: skip
        self.scheduler_waits = Histogram(
            P + "gateway_scheduler_wait_seconds", "How long a submit that found no scheduler "
            "subscribed asked again, by whether one then answered (answered, unanswered)",
            ["outcome"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            P + "inter_token_latency_seconds", "Gap between token chunks",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.requests = Counter(
            P + "requests", "Requests ended, by finish reason (error: failed)",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens delivered to clients", registry=r
        )
        self.running = Gauge(P + "num_requests_running", "Requests streaming", registry=r)
        self.migrations = Counter(
            P + "request_migrations", "Requests resubmitted after a worker was lost", registry=r
        )


@dataclass(slots=True)
class SchedulerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    workers: Gauge = field(init=False)
    waiting: Gauge = field(init=False)
    placements: Counter = field(init=False)
    adapter_placements: Counter = field(init=False)
    queue_wait: Histogram = field(init=False)
    ttft_error: Histogram = field(init=False)
    tenant_tokens: Counter = field(init=False)
    tenant_wait: Histogram = field(init=False)
    kv_fallbacks: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.kv_fallbacks = Counter(
            P + "scheduler_kv_fallbacks", "Requests prefilled where they decode to keep off the "
            "KV link of a failed hand-off: their own earlier attempt's (request) or their "
            "decode worker's pairs' (pair)", ["reason"], registry=r,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            P + "scheduler_tenant_tokens", "Tokens booked to each tenant by its placed "
            "requests (prompt + max_tokens: fair share)", ["tenant"], registry=r,
        )  # fmt: skip
        self.tenant_wait = Histogram(
            P + "scheduler_tenant_queue_seconds",
            "Arrival to answer of each tenant's submits (placed or refused)",
            ["tenant"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.workers = Gauge(
            P + "workers", "Registered workers by model, role and state",
            ["model", "role", "state"], registry=r,
        )  # fmt: skip
        self.waiting = Gauge(P + "num_requests_waiting", "Submits being placed", registry=r)
        self.placements = Counter(
            P + "placements", "Submits answered, by model, outcome and path",
            ["model", "outcome", "path"], registry=r,
        )  # fmt: skip
        self.adapter_placements = Counter(
            P + "adapter_placements", "LoRA requests placed, per worker they went to, by model, "
            "adapter and whether it was in a slot there (loaded) or the worker loads it (load)",
            ["model", "adapter", "affinity"], registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            P + "scheduler_queue_wait_seconds",
            "Arrival to answer of submits that waited for a worker with room, by outcome",
            ["outcome"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft_error = Histogram(
            P + "scheduler_ttft_prediction_error_seconds",
            "Observed minus predicted TTFT of placed requests, by the path chosen "
            "(disaggregated, decode_only)",
            ["path"], buckets=ERROR_BUCKETS, registry=r,
        )  # fmt: skip


class ConstantLabels(Collector):
    """Every sample of `inner` with `labels` added: one process's identity on all its
    metrics (a worker's `model`, as vLLM labels its metrics with `model_name`)."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self.inner = inner
        self.labels = labels

    def collect(self) -> Iterable[Metric]:
        for family in self.inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                sample._replace(labels=sample.labels | self.labels) for sample in family.samples
            ]
            yield labelled


@dataclass(slots=True)
class WorkerMetrics:
    """Labelled by `role` (prefill | decode | both), so pools aggregate in PromQL, and by
    `model` (the served name the worker reports) when it is given."""

    role: str
    model: str = ""
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    queue_time: Histogram = field(init=False)
    running: Gauge = field(init=False)
    waiting: Gauge = field(init=False)
    kv_usage: Gauge = field(init=False)
    prefix_queries: Counter = field(init=False)
    prefix_hits: Counter = field(init=False)
    transfer_seconds: Histogram = field(init=False)
    transfer_bytes: Counter = field(init=False)
    transfer_failures: Counter = field(init=False)
    generation_tokens: Counter = field(init=False)
    preemptions: Counter = field(init=False)
    spec_proposed: Counter = field(init=False)
    spec_accepted: Counter = field(init=False)
    spec_verify_steps: Counter = field(init=False)
    spec_acceptance: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r, role = self.registry, ["role"]
        if self.model:  # the metrics live in their own registry; the served one labels them
            r = CollectorRegistry()
            self.registry.register(ConstantLabels(r, {"model": self.model}))
        # direction: send (prefill) | receive (decode); transport: nixl | nats
        direction = ["role", "direction", "transport"]
        self.queue_time = Histogram(
            P + "request_queue_time_seconds", "Task arrival to the engine step computing it",
            role, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.running = Gauge(P + "num_requests_running", "Running in the engine", role, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Waiting in the engine", role, registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_ratio", "KV blocks in use", role, registry=r)
        self.prefix_queries = Counter(
            P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", role,
            registry=r,
        )  # fmt: skip
        self.prefix_hits = Counter(
            P + "prefix_cache_hits", "Prompt tokens served from the prefix cache", role,
            registry=r,
        )  # fmt: skip
        self.transfer_seconds = Histogram(
            P + "kv_transfer_seconds", "One request's KV transfer", direction,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.transfer_bytes = Counter(
            P + "kv_transfer_bytes", "KV bytes moved between workers", direction, registry=r
        )
        self.transfer_failures = Counter(
            P + "kv_transfer_failures", "KV transfers failed", direction, registry=r
        )
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens sampled by this worker", role, registry=r
        )
        self.preemptions = Counter(
            P + "num_preemptions", "Running sequences preempted (recomputed)", role, registry=r
        )
        self.spec_proposed = Counter(
            P + "spec_decode_proposed_tokens", "Draft tokens verified (speculative decoding)",
            role, registry=r,
        )  # fmt: skip
        self.spec_accepted = Counter(
            P + "spec_decode_accepted_tokens", "Draft tokens accepted", role, registry=r
        )
        self.spec_verify_steps = Counter(
            P + "spec_decode_verify_steps", "Verify chunks computed", role, registry=r
        )
        self.spec_acceptance = Gauge(
            P + "spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start",
            role, registry=r,
        )  # fmt: skip


def serve_metrics(
    registry: CollectorRegistry,
    port: int,
    host: str = "0.0.0.0",
    ready: Callable[[], bool] = lambda: True,
) -> int:
    """Serve, in a daemon thread, `registry` at http://host:port/metrics, `/health` (200
    while the process runs: the liveness probe) and `/ready` (200 while `ready()` is true,
    else 503: the readiness probe); other paths are 404. Returns the port bound."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/health":
            status, body = "200 OK", b"ok\n"
        elif path == "/ready" and ready():
            status, body = "200 OK", b"ready\n"
        elif path == "/ready":
            status, body = "503 Service Unavailable", b"not ready\n"
        else:
            status, body = "404 Not Found", b"not found\n"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server.server_port
