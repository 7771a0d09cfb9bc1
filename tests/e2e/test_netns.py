"""The mesh across network namespaces, as across hosts: the prefill worker and two decode
workers each in its own namespace, joined to the host's by a veth pair on one bridge, so
NATS and the KV data plane (NIXL over UCX's TCP, `UCX_TLS=tcp,self`) cross distinct
addresses. Under load one decode worker's link is cut (its veth set down): the scheduler
loses its heartbeats, the gateway migrates its streams to the other decode worker, and
every stream completes with the engine's own text. Needs root and `ip netns`; prints a
`CHAOS` line for the README's "Failure behaviour" row."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from shared.bus import Bus
from shared.nats_server import start_nats_server
from shared.ports import free_port
from shared.protocol import MeshStatus, StatusQuery
from shared.subjects import Subjects
from tests.e2e.test_chaos import assert_same_texts, make_jobs, reference, report, run_load
from tests.e2e.test_mesh import mesh_model_dir  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and `ip netns`"
    ),
]
BRIDGE, HOST_IP = "ssbr0", "10.77.0.1"
WORKERS = {"p0": ("prefill", "10.77.0.11"), "d0": ("decode", "10.77.0.21"),
           "d1": ("decode", "10.77.0.22")}  # fmt: skip
STREAMS = 8


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def build_network() -> None:
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    for name, (_, address) in WORKERS.items():
        ns, host_end, ns_end = f"ss-{name}", f"ss-{name}-h", f"ss-{name}-n"
        ip("netns", "add", ns)
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        ip("link", "set", ns_end, "netns", ns)
        ip("link", "set", host_end, "master", BRIDGE)
        ip("link", "set", host_end, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", ns_end)
        ip("netns", "exec", ns, "ip", "link", "set", ns_end, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")


def tear_down_network() -> None:
    for name in WORKERS:
        subprocess.run(["ip", "link", "del", f"ss-{name}-h"], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", f"ss-{name}"], capture_output=True, timeout=10)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, timeout=10)


@dataclass
class Spread:
    """What the chaos helpers need of a mesh: its base URL and an SDK client."""

    base: str
    client: openai.OpenAI
    nats_url: str


@pytest.fixture(scope="module")
def spread(mesh_model_dir, tmp_path_factory) -> Iterator[Spread]:  # noqa: F811
    tear_down_network()  # what a killed earlier run left
    build_network()
    home = tmp_path_factory.mktemp("netns")
    processes: list[subprocess.Popen] = []
    nats = start_nats_server(home / "nats", host=HOST_IP)
    env = os.environ | {"PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp,self"}

    def start(name: str, argv: list[str], namespace: str = "") -> None:
        command = [sys.executable, "-m", "services.cli", *argv, "--nats", nats.url]
        if namespace:
            command = ["ip", "netns", "exec", namespace, *command]
        log = (home / f"{name}.log").open("w")
        processes.append(
            subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )

    port = free_port()
    try:
        start("scheduler", ["scheduler", "--metrics-port", "0"])
        for name, (role, _) in WORKERS.items():
            argv = ["worker", "--role", role, "--worker-id", name, "--model-dir"]
            start(name, [*argv, str(mesh_model_dir), "--metrics-port", "0"], f"ss-{name}")
        start("gateway", ["gateway", "--model-dir", str(mesh_model_dir), "--port", str(port),
                          "--stall-timeout", "5"])  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        wait_for_workers(nats.url, home, 3)
        deadline = time.monotonic() + 60
        while not ready(base):
            assert time.monotonic() < deadline, "gateway not ready"
            time.sleep(0.5)
        yield Spread(base, openai.OpenAI(base_url=f"{base}/v1", api_key="x"), nats.url)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        nats.stop()
        tear_down_network()


def ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/ready", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def status(nats_url: str) -> MeshStatus:
    async def ask() -> MeshStatus:
        bus = await Bus.connect(nats_url, "test")
        try:
            return await bus.request(Subjects().status, StatusQuery(), MeshStatus, 5)
        finally:
            await bus.close()

    return asyncio.run(ask())


def wait_for_workers(nats_url: str, home: Path, count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if len(status(nats_url).workers) >= count:
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-2000:] for p in home.glob("*.log")}
            raise AssertionError(f"{count} workers not registered: {logs}")
        time.sleep(1)


def test_cutting_a_decode_workers_link_mid_stream(spread, mesh_model_dir):  # noqa: F811
    beats = {w.heartbeat.worker_id: w.heartbeat for w in status(spread.nats_url).workers}
    assert {"p0", "d0", "d1"} <= beats.keys()
    jobs = make_jobs(31)[:STREAMS]
    expected = reference(mesh_model_dir, jobs)
    cut = lambda: ip("link", "set", "ss-d0-h", "down")  # noqa: E731
    outcomes = run_load(spread, jobs, cut, after_chunks=10)
    _, failed, hung = report("netns link cut (decode d0)", outcomes)
    assert (failed, hung) == (0, 0), [o.error for o in outcomes]
    assert_same_texts(jobs, outcomes, expected)
    peers = prefill_peers(spread.nats_url)
    print("KV from p0 (decode worker: transport):", peers)
    assert peers.keys() == {"d0", "d1"}  # both took streams: the cut hit live ones


def prefill_peers(nats_url: str, timeout_s: float = 15.0) -> dict[str, str]:
    """p0's KV peers (decode worker id: transport) once its heartbeats name both decode
    workers, or what they named last after `timeout_s` (a loaded machine beats late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        prefill = next(
            w.heartbeat for w in status(nats_url).workers if w.heartbeat.worker_id == "p0"
        )
        peers = {peer.worker_id: peer.transport for peer in prefill.kv_peers}
        if peers.keys() >= {"d0", "d1"} or time.monotonic() > deadline:
            return peers
        time.sleep(0.5)
