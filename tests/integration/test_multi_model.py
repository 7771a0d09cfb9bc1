"""Several models in one mesh, as users run it: `splitserve up --config FILE` with two models
(a tiny random model with the real tokenizer, under two names, one aggregated worker each)
and an external OpenAI-compatible upstream in a second process. A handful of requests
each: the weighted route reaches both models, a prompt-size rule picks the model, fallbacks
answer within a couple of seconds when an upstream is unreachable or silent and when a
model's workers stop, a canary's traffic class shows in /metrics and on every span."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.ports import free_port
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.e2e.test_mesh import mesh_model_dir  # noqa: F401  (fixture)
from tests.integration.test_observability import Receiver, metric, metrics_ports, scrape

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TRACE = "5cf92f3577b34da6a3ce929d0e0e4737"


def mesh_yaml(model_dir: Path, upstream: int, dead: int) -> str:
    return f"""\
models:
  - {{name: smol-a, model_dir: {model_dir}, aggregated: 1}}
  - {{name: smol-b, model_dir: {model_dir}, aggregated: 1}}
  - name: remote-x
    upstream: http://127.0.0.1:{upstream}/v1
    upstream_model: up-model
  - {{name: remote-dead, upstream: "http://127.0.0.1:{dead}/v1", connect_timeout: 1}}
  - name: remote-silent
    upstream: http://127.0.0.1:{upstream}/v1
    upstream_model: hang            # the fake upstream never answers this one
    response_timeout: 1
routes:
  - name: chat
    targets: [{{model: smol-a, weight: 1}}, {{model: smol-b, weight: 1}}]
  - name: canaried
    targets: [{{model: smol-a, weight: 1}}, {{model: smol-b, weight: 1, traffic: canary}}]
  - name: auto
    rules: [{{max_prompt_tokens: 64, model: smol-a}}, {{model: remote-x}}]
fallbacks:
  remote-dead: [smol-b]
  remote-silent: [smol-b]
  smol-a: [remote-x]
"""


@dataclass
class Reply:
    status: int
    body: dict
    headers: dict[str, str]
    seconds: float


@dataclass
class MultiMesh:
    process: subprocess.Popen[bytes]
    base: str
    log: Path

    def post(self, model: str, content: str = "Hi", headers: dict | None = None, **extra) -> Reply:
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        body |= {"max_tokens": 2, "temperature": 0} | extra
        request = urllib.request.Request(
            f"{self.base}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                raw, status, got = answer.read(), answer.status, dict(answer.headers)
        except urllib.error.HTTPError as err:
            raw, status, got = err.read(), err.code, dict(err.headers)
        seconds = time.monotonic() - started
        if body.get("stream"):
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")]
            return Reply(status, {"chunks": [json.loads(e) for e in events]}, got, seconds)
        return Reply(status, json.loads(raw), got, seconds)

    def worker_pids(self, worker_id: str) -> list[int]:
        """The launcher's children started with `--worker-id worker_id`."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == self.process.pid and worker_id.encode() in argv:
                pids.append(int(entry.name))
        return pids


def wait_ready(mesh: MultiMesh, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert mesh.process.poll() is None, mesh.log.read_text()
        if _workers_of(mesh, "smol-a") and _workers_of(mesh, "smol-b"):
            return
        time.sleep(0.5)
    raise AssertionError(f"mesh not ready in {timeout}s:\n{mesh.log.read_text()}")


def _workers_of(mesh: MultiMesh, model: str) -> float:
    try:
        samples = scrape_scheduler(mesh)
    except OSError:
        return 0
    return metric(samples, "splitserve_workers", model=model, state="ready")


def scrape_scheduler(mesh: MultiMesh) -> dict:
    """The scheduler's metrics: its port is in the launcher's log."""
    for line in mesh.log.read_text().splitlines():
        if "scheduler: metrics on" in line:
            return scrape(int(line.rsplit(":", 1)[1].split("/")[0]))
    raise OSError("no scheduler metrics port yet")


@pytest.fixture(scope="module")
def receiver() -> Receiver:
    receiver = Receiver()
    receiver.start()
    return receiver


@pytest.fixture(scope="module")
def mesh(mesh_model_dir, receiver, tmp_path_factory) -> Iterator[MultiMesh]:  # noqa: F811
    home = tmp_path_factory.mktemp("multi")
    upstream_port, port = free_port(), free_port()
    config = home / "mesh.yaml"
    config.write_text(mesh_yaml(mesh_model_dir, upstream_port, free_port()))
    env = {**os.environ, "SPLITSERVE_HOME": str(home), "PYTHONUNBUFFERED": "1",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
    upstream = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.fake_upstream", str(upstream_port)], env=env
    )
    log = home / "up.log"
    argv = [sys.executable, "-m", "services.cli", "up", "--config", str(config),
            "--port", str(port), "--otlp-endpoint", receiver.endpoint,
            "--heartbeat-timeout", "1.5"]  # fmt: skip
    process = subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    multi = MultiMesh(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_ready(multi)
        yield multi
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        upstream.kill()  # it may be holding a silent request open
        upstream.wait(10)


def test_models_and_routes_are_listed(mesh):
    with urllib.request.urlopen(f"{mesh.base}/v1/models", timeout=10) as answer:
        cards = {card["id"]: card["splitserve_kind"] for card in json.loads(answer.read())["data"]}
    assert cards == {
        "smol-a": "model", "smol-b": "model", "remote-x": "upstream", "remote-dead": "upstream",
        "remote-silent": "upstream", "chat": "route", "canaried": "route", "auto": "route",
    }  # fmt: skip


def test_a_weighted_route_reaches_both_models_and_says_so(mesh):
    served = []
    for _ in range(16):  # both 1:1 targets: all on one model has odds 2 / 2^16
        reply = mesh.post("chat")
        assert reply.status == 200, reply.body
        model = reply.body["model"]
        assert reply.headers["x-splitserve-route"] == f"route=chat; target={model}; served={model}"
        served.append(model)
    assert set(served) == {"smol-a", "smol-b"}
    placed = scrape_scheduler(mesh)  # each model's worker took its own requests
    ports = metrics_ports(mesh.log)
    for model in ("smol-a", "smol-b"):
        assert metric(
            placed, "splitserve_placements_total", model=model, outcome="accepted"
        ) >= served.count(model)
        worker = scrape(ports[f"{model}-both-0"])  # its own metrics name its model
        assert metric(worker, "splitserve_generation_tokens_total", model=model) > 0


def test_a_prompt_size_rule_picks_the_model(mesh):
    short = mesh.post("auto", "Hi")  # 31 tokens with the chat template; the long one 111
    assert short.body["model"] == "smol-a", short.body
    long = mesh.post("auto", "tell me a story " * 20)
    assert long.status == 200 and long.body["model"] == "remote-x", long.body
    assert long.body["choices"][0]["message"]["content"] == "upstream up-model"
    stream = mesh.post("remote-x", stream=True)
    assert {c["model"] for c in stream.body["chunks"]} == {"remote-x"}
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in stream.body["chunks"]).strip()
        == "upstream up-model"
    )


@pytest.mark.parametrize("model", ["remote-dead", "remote-silent"])
def test_an_unreachable_or_silent_upstream_falls_back_at_once(mesh, model):
    reply = mesh.post(model)
    assert reply.status == 200 and reply.body["model"] == "smol-b", reply.body
    assert reply.seconds < 2.5, reply.seconds
    status = 502 if model == "remote-dead" else 504
    route = f"route=-; target={model}; served=smol-b; fallbacks={model}:{status}"
    assert reply.headers["x-splitserve-route"] == route
    stream = mesh.post(model, stream=True)  # before its first token, a stream falls back too
    assert stream.status == 200 and {c["model"] for c in stream.body["chunks"]} == {"smol-b"}


def test_canary_traffic_is_labelled_in_metrics_and_on_every_span(mesh, receiver):
    headers = {"x-splitserve-traffic": "canary", "traceparent": f"00-{TRACE}-b7ad6b7169203331-01"}
    reply = mesh.post("canaried", headers=headers)
    assert reply.status == 200 and reply.body["model"] == "smol-b", (
        reply.body
    )  # its reserved target
    with urllib.request.urlopen(f"{mesh.base}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    labels = 'model="smol-b",route="canaried",status="200",traffic="canary"'
    assert f"splitserve_gateway_requests_total{{{labels}}}" in text
    names = {"gateway.request", "scheduler.route", "decode.generate"}
    spans = receiver.trace(TRACE, names)
    assert names <= spans.keys(), sorted(spans)
    assert {s.attributes.get("splitserve.traffic") for group in spans.values() for s in group} == {
        "canary"
    }
    bad = mesh.post("chat", headers={"x-splitserve-traffic": "two words"})
    assert bad.status == 400 and "x-splitserve-traffic" in bad.body["error"]["message"]


def test_a_model_whose_workers_stopped_falls_back(mesh):
    (pid,) = mesh.worker_pids("smol-a-both-0")
    os.kill(pid, signal.SIGSTOP)  # no more heartbeats: the scheduler expires it
    try:
        deadline = time.monotonic() + 10
        while _workers_of(mesh, "smol-a") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _workers_of(mesh, "smol-a")
        reply = mesh.post("smol-a")
        assert reply.status == 200 and reply.body["model"] == "remote-x", reply.body
        assert reply.seconds < 2, reply.seconds
        assert reply.headers["x-splitserve-route"].endswith("served=remote-x; fallbacks=smol-a:503")
    finally:
        os.kill(pid, signal.SIGCONT)
    # It beats again and rejoins as a new registration: its model is served by it again.
    deadline = time.monotonic() + 10
    while not _workers_of(mesh, "smol-a") and time.monotonic() < deadline:
        time.sleep(0.2)
    reply = mesh.post("smol-a")
    assert reply.status == 200 and reply.body["model"] == "smol-a", reply.body
