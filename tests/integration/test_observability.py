"""Traces and metrics of the whole mesh (`splitserve up` as processes, tiny random model with
the real tokenizer), exported to an OTLP/HTTP receiver this test runs (aiohttp, protobuf
decoded with opentelemetry-proto) and scraped from every service's /metrics.
With SPLITSERVE_TRACE_OUT=FILE the streamed request's spans are also written there as
JSON (docs/trace_picture.py draws the README's picture from them)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from shared.kvtransfer.nixl_transport import nixl_available
from shared.ports import free_port
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
MESSAGE = [{"role": "user", "content": "What is the capital of France?"}]
SERVICES = {f"splitserve-{s}" for s in ("gateway", "scheduler", "prefill", "decode")}
OK, ERROR = 0, 2  # otlp Status.code: UNSET, ERROR


@dataclass(frozen=True, slots=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    status: int
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1, serving from its own thread."""

    port: int = field(default_factory=free_port)
    spans: list[Span] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def on_traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                self.spans += [_span(resource["service.name"], s) for s in scope.spans]
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    def start(self) -> None:
        ready = threading.Event()

        async def serve() -> None:
            app = web.Application()
            app.router.add_post("/v1/traces", self.on_traces)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            ready.set()
            await asyncio.Event().wait()

        threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
        assert ready.wait(10)

    def trace(self, trace_id: str, until: set[str], timeout: float = 15) -> dict[str, list[Span]]:
        """The spans of `trace_id` by name, once every name in `until` has arrived."""
        deadline = time.monotonic() + timeout
        while True:
            by_name: dict[str, list[Span]] = {}
            for span in list(self.spans):
                if span.trace_id == trace_id:
                    by_name.setdefault(span.name, []).append(span)
            if until <= by_name.keys() or time.monotonic() > deadline:
                return by_name
            time.sleep(0.1)


def _span(service: str, s) -> Span:
    attributes = {}
    for a in s.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        if kind == "array_value":
            value = [getattr(v, v.WhichOneof("value")) for v in value.values]
        attributes[a.key] = value
    return Span(
        service,
        s.name,
        s.trace_id.hex(),
        s.span_id.hex(),
        s.parent_span_id.hex(),
        attributes,
        s.status.code,
        s.start_time_unix_nano,
        s.end_time_unix_nano,
    )


@pytest.fixture(scope="module")
def receiver() -> Receiver:
    receiver = Receiver()
    receiver.start()
    return receiver


@pytest.fixture(scope="module")
def mesh(mesh_model_dir, receiver, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export spans within 0.1 s
        home = tmp_path_factory.mktemp("home")
        # Every request disaggregated, even once the decode worker holds the prompt's blocks
        # (else whether it is depends on its KV events reaching the scheduler in time), and
        # by the fixed rule (measured costs would send an idle mesh's requests decode-only).
        flags = ["--otlp-endpoint", receiver.endpoint, "--local-prefill-tokens", "0"]
        flags += ["--path-choice", "fixed"]
        yield from start_mesh(mesh_model_dir, home, flags)


def test_one_streamed_request_is_one_trace_across_all_services(mesh, receiver):
    model = mesh.client.models.list().data[0].id
    stream = mesh.client.chat.completions.create(
        model=model,
        messages=MESSAGE,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
    )
    usage = next(chunk.usage for chunk in stream if chunk.usage)
    names = {"gateway.request", "scheduler.route", "prefill.queue", "prefill.compute"}
    names |= {"kv.transfer", "decode.queue", "decode.generate"}
    spans = receiver.trace(CLIENT_TRACE, names)
    assert names <= spans.keys(), sorted(spans)
    assert {s.service for group in spans.values() for s in group} == SERVICES
    (gateway,) = spans["gateway.request"]
    (route,) = spans["scheduler.route"]
    send, receive = sorted(spans["kv.transfer"], key=lambda s: s.service != "splitserve-prefill")
    assert gateway.parent_id == CLIENT_SPAN  # the client's traceparent is continued
    assert route.parent_id == gateway.span_id
    for name in ("prefill.queue", "prefill.compute"):
        assert spans[name][0].parent_id == route.span_id
    assert send.parent_id == route.span_id and receive.parent_id == send.span_id
    for name in ("decode.queue", "decode.generate"):
        assert spans[name][0].parent_id == receive.span_id
    assert gateway.attributes["http.response.status_code"] == 200
    assert gateway.attributes["gen_ai.request.model"] == model
    assert gateway.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert gateway.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert gateway.attributes["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    assert route.attributes["splitserve.disaggregated"] is True
    assert route.attributes["splitserve.prefill_worker"] == "prefill-0"
    assert route.attributes["splitserve.decode_worker"] == "decode-0"
    assert route.attributes["splitserve.prefix_hit_blocks"] >= 0
    transport = "nixl" if nixl_available()[0] else "nats"  # `up` takes nixl where it loads
    for side in (send, receive):
        assert side.attributes["splitserve.kv.transport"] == transport
        assert side.attributes["splitserve.kv.blocks"] > 0
        assert side.attributes["splitserve.kv.bytes"] > 0
    assert receive.attributes["splitserve.kv.bytes"] == send.attributes["splitserve.kv.bytes"]
    generate = spans["decode.generate"][0]
    assert generate.attributes["splitserve.tokens"] == usage.completion_tokens - 1  # 1st: prefill
    assert generate.attributes["splitserve.steps"] >= 1
    queue, compute = spans["prefill.queue"][0], spans["prefill.compute"][0]
    assert queue.end_ns <= compute.start_ns <= compute.end_ns <= send.start_ns
    assert all(s.status == OK for group in spans.values() for s in group)
    if out := os.environ.get("SPLITSERVE_TRACE_OUT"):  # for docs/trace_picture.py
        trace = [dataclasses.asdict(s) for group in spans.values() for s in group]
        Path(out).write_text(json.dumps(trace, indent=1))


def test_a_failed_request_has_an_error_span(mesh, receiver):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with pytest.raises(openai.BadRequestError):
        mesh.client.chat.completions.create(
            model="no-such-model",
            messages=MESSAGE,
            extra_headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
        )
    (gateway,) = receiver.trace(trace_id, {"gateway.request"})["gateway.request"]
    assert gateway.status == ERROR
    assert gateway.attributes["http.response.status_code"] == 400


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum over the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def metrics_ports(log: Path) -> dict[str, int]:
    found = re.findall(r"(\S+): metrics on http://[^:]+:(\d+)/metrics", log.read_text())
    return {name: int(port) for name, port in found}


def test_metrics_move_by_what_the_clients_saw(mesh):
    ports = metrics_ports(mesh.log_path) | {"gateway": mesh.port}
    assert {"scheduler", "prefill-0", "decode-0", "gateway"} <= ports.keys()
    before = {name: scrape(port) for name, port in ports.items()}
    model = mesh.client.models.list().data[0].id
    usages = []
    for max_tokens in (5, 9, 13):
        reply = mesh.client.chat.completions.create(
            model=model, messages=MESSAGE, max_tokens=max_tokens, temperature=0
        )
        usages.append(reply.usage)
    # A prompt of whole blocks, all cached on the decode worker, would go decode-only.
    assert usages[0].prompt_tokens % 16
    time.sleep(1.5)  # a heartbeat refreshes the workers' gauges and prefix counters
    after = {name: scrape(port) for name, port in ports.items()}

    def moved(service: str, name: str, **labels: str) -> float:
        return metric(after[service], name, **labels) - metric(before[service], name, **labels)

    completion = sum(u.completion_tokens for u in usages)
    assert moved("gateway", "splitserve_generation_tokens_total") == completion
    prompt = sum(u.prompt_tokens for u in usages)
    assert moved("gateway", "splitserve_prompt_tokens_total") == prompt
    assert moved("gateway", "splitserve_requests_total") == 3
    for name in ("time_to_first_token", "e2e_request_latency"):
        assert moved("gateway", f"splitserve_{name}_seconds_count") == 3
    assert moved("gateway", "splitserve_inter_token_latency_seconds_count") == completion - 3
    accepted = {"outcome": "accepted", "path": "disaggregated"}
    assert moved("scheduler", "splitserve_placements_total", **accepted) == 3
    for role in ("prefill", "decode"):
        assert metric(after["scheduler"], "splitserve_workers", role=role, state="ready") == 1
    assert moved("prefill-0", "splitserve_request_queue_time_seconds_count") == 3
    assert moved("prefill-0", "splitserve_generation_tokens_total") == 3
    assert moved("decode-0", "splitserve_generation_tokens_total") == completion - 3
    for worker, direction in (("prefill-0", "send"), ("decode-0", "receive")):
        assert moved(worker, "splitserve_kv_transfer_seconds_count", direction=direction) == 3
        assert moved(worker, "splitserve_kv_transfer_bytes_total", direction=direction) > 0
        assert moved(worker, "splitserve_prefix_cache_queries_total") > 0
        assert metric(after[worker], "splitserve_kv_transfer_failures_total") == 0
        assert 0 <= metric(after[worker], "splitserve_kv_cache_usage_ratio") < 1
    assert moved("prefill-0", "splitserve_prefix_cache_hits_total") > 0  # the same prompt


def test_the_observed_ttft_is_compared_with_the_prediction(mesh, receiver):
    """Once the workers have measured their costs (the requests above), a placement carries
    a predicted TTFT; the prefill worker reports the observed one in its next heartbeat,
    and the scheduler records the error and a span under the request's route span."""
    model = mesh.client.models.list().data[0].id
    mesh.client.chat.completions.create(model=model, messages=MESSAGE, max_tokens=2)
    time.sleep(1.5)  # the workers' next heartbeats carry what that request measured
    port = metrics_ports(mesh.log_path)["scheduler"]
    name = "splitserve_scheduler_ttft_prediction_error_seconds_count"
    before = metric(scrape(port), name, path="disaggregated")
    trace_id = "5b8aa5a2d2c872e8321cf37308d69df2"
    mesh.client.chat.completions.create(
        model=model,
        messages=MESSAGE,
        max_tokens=3,
        extra_headers={"traceparent": f"00-{trace_id}-a2fb4a1d1a96d312-01"},
    )
    names = {"scheduler.route", "scheduler.first_token"}
    spans = receiver.trace(trace_id, names)
    assert names <= spans.keys(), sorted(spans)
    (route,), (first,) = spans["scheduler.route"], spans["scheduler.first_token"]
    assert first.parent_id == route.span_id
    assert route.attributes["splitserve.path"] == "disaggregated"
    predicted = route.attributes["splitserve.predicted_ttft_s"]
    assert predicted > 0
    assert first.attributes["splitserve.predicted_ttft_s"] == predicted
    observed = first.attributes["splitserve.observed_ttft_s"]
    assert first.attributes["splitserve.ttft_error_s"] == pytest.approx(observed - predicted)
    assert first.attributes["splitserve.worker"] == "prefill-0"
    assert metric(scrape(port), name, path="disaggregated") == before + 1
