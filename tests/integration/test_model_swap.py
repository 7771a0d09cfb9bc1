"""A model swap under load, as a user runs it: `splitserve up --config FILE` serving route
`chat` -> smol-a (a tiny random model with the real tokenizer), two clients streaming on
`chat` without a pause; FILE rewritten to serve smol-b instead and `up` sent SIGHUP. Every
request answers 200 with its whole stream, the route moves to smol-b, smol-a's worker
drains and exits. Then a bad file: POST /admin/reload answers 400 and SIGHUP is refused
in the log, and the mesh goes on serving smol-b."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadtest.mesh import stop_group
from shared.ports import free_port
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.e2e.test_mesh import mesh_model_dir  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RAMP_S = 4.0


def mesh_yaml(model_dir: Path, model: str) -> str:
    return f"""\
models:
  - {{name: {model}, model_dir: {model_dir}, aggregated: 1, engine: {{dtype: float32}}}}
routes:
  - name: chat
    targets: [{{model: {model}, weight: 1}}]
"""


@dataclass
class Answer:
    status: int
    model: str = ""
    finished: bool = False  # the stream ended with a finish_reason and [DONE]
    error: str = ""


@dataclass
class Load:
    base: str
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, seed: int) -> None:
        while not self.stop.is_set():
            self.answers.append(stream(self.base, seed))


def stream(base: str, seed: int) -> Answer:
    body = {"model": "chat", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "max_tokens": 8, "temperature": 0.8, "seed": seed, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            lines = answer.read().decode().splitlines()
            status = answer.status
    except urllib.error.HTTPError as err:
        return Answer(err.code, error=err.read().decode())
    except OSError as exc:
        return Answer(0, error=repr(exc))
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    finished = bool(chunks) and chunks[-1]["choices"][0].get("finish_reason") is not None
    finished = finished and lines[-1] in ("data: [DONE]", "") and "data: [DONE]" in lines
    return Answer(status, chunks[0]["model"] if chunks else "", finished)


def post_reload(base: str) -> tuple[int, str]:
    request = urllib.request.Request(f"{base}/admin/reload", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_for(log: Path, text: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        if text in log.read_text():
            return
        time.sleep(0.3)
    raise AssertionError(f"no {text!r} in {timeout}s:\n{log.read_text()}")


@pytest.fixture
def up(mesh_model_dir, tmp_path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, Path]]:  # noqa: F811
    config = tmp_path / "mesh.yaml"
    config.write_text(mesh_yaml(mesh_model_dir, "smol-a"))
    port, log = free_port(), tmp_path / "up.log"
    env = {**os.environ, "SPLITSERVE_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1",
           "SPLITSERVE_SWAP_RAMP": str(RAMP_S)}  # fmt: skip
    argv = [sys.executable, "-m", "services.cli", "up", "--config", str(config),
            "--port", str(port), "--heartbeat-timeout", "1.5"]  # fmt: skip
    process = subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        wait_for(log, "splitserve is up", process, 180)
        yield process, f"http://127.0.0.1:{port}", config, log
    finally:
        stop_group(process)


def test_a_model_swap_under_load_fails_no_request(up, mesh_model_dir):  # noqa: F811
    process, base, config, log = up
    load = Load(base)
    clients = [threading.Thread(target=load.run, args=(seed,)) for seed in (1, 2)]
    for client in clients:
        client.start()
    try:
        time.sleep(3)
        config.write_text(mesh_yaml(mesh_model_dir, "smol-b"))
        os.kill(process.pid, signal.SIGHUP)
        wait_for(log, "reload of", process, 180)  # new worker ready, ramp, old one retired
        wait_for(log, "smol-a-both-0 drained and exited", process, 60)
        time.sleep(1)  # a stream smol-a finished as it exited has reached its client
        served_after = len(load.answers)
        time.sleep(3)
    finally:
        load.stop.set()
        for client in clients:
            client.join(150)
    failed = [a for a in load.answers if a.status != 200 or not a.finished]
    assert not failed, (failed[:3], log.read_text()[-4000:])
    models = [a.model for a in load.answers]
    assert models[0] == "smol-a" and "smol-b" in models
    assert set(models[served_after:]) == {"smol-b"}, models

    config.write_text("models: [")  # a bad file: refused, the mesh serves on
    status, text = post_reload(base)
    assert status == 400 and "reload refused" in text and "not valid YAML" in text, text
    os.kill(process.pid, signal.SIGHUP)
    wait_for(log, "reload refused, the mesh serves as before", process, 30)
    answer = stream(base, 3)
    assert (answer.status, answer.model, answer.finished) == (200, "smol-b", True), answer
