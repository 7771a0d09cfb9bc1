"""Issue 60, case 7: a soak (`make chaos` only). A mixed stream of greedy and seeded
requests runs through `splitserve up` (2 prefill, 2 decode workers, on a nats-server the
test owns) while every `SPLITSERVE_SOAK_PERIOD_S` (60) seconds a random fault strikes: a
worker or the scheduler SIGKILLed (the launcher restarts it), or the nats-server
restarted. For `SPLITSERVE_SOAK_S` seconds (1800). Checked: nothing hangs; every completed
stream is the engine's own text; failures only come with a nats-server restart (the
requests in flight then fail with a clear error, DESIGN.md section 6); the mesh's memory
(the RSS of its processes) ends within 1.5x of where it stood after the first period."""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_chaos import (
    Outcome,
    make_jobs,
    own_nats,  # noqa: F401 (a fixture)
    reference,
    stream_one,
    worker_pid,
)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]
SOAK_S = float(os.environ.get("SPLITSERVE_SOAK_S", "1800"))
PERIOD_S = float(os.environ.get("SPLITSERVE_SOAK_PERIOD_S", "60"))
CLIENTS = 4


@pytest.fixture(scope="module")
def soak_mesh(mesh_model_dir, tmp_path_factory, own_nats) -> Iterator[Mesh]:  # noqa: F811
    home = tmp_path_factory.mktemp("chaos-soak")
    flags = ["--prefill", "2", "--decode", "2", "--nats", own_nats.server.url]
    for mesh in start_mesh(mesh_model_dir, home, flags):
        mesh.nats_port = own_nats.server.port
        yield mesh


def mesh_rss_kib(mesh: Mesh) -> int:
    """The resident memory of `splitserve up` and every process under it, in KiB."""
    parents, rss = {}, {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                status = (entry / "status").read_text()
                fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                parents[int(entry.name)] = int(fields["PPid"])
                rss[int(entry.name)] = int(fields.get("VmRSS", "0 kB").split()[0])
        except (OSError, ValueError, KeyError):
            continue

    def under_up(pid: int) -> bool:
        while pid > 1:
            if pid == mesh.process.pid:
                return True
            pid = parents.get(pid, 0)
        return False

    return sum(kib for pid, kib in rss.items() if under_up(pid))


def pick_fault(mesh: Mesh, rng: random.Random) -> str:
    """A live worker's id (restarts are `<id>-r<n>`), the scheduler, or the nats-server."""
    workers = sorted(w.heartbeat.worker_id for w in mesh.status().workers)
    return rng.choice([*workers, "scheduler", "nats"])


def test_soak_with_a_fault_every_period(soak_mesh, mesh_model_dir, own_nats):  # noqa: F811
    jobs = make_jobs(71)[:8]
    expected = reference(mesh_model_dir, jobs)
    stop = threading.Event()
    results: list[tuple[int, Outcome, float]] = []  # (job, outcome, when it ended)

    def client(seed: int) -> None:
        rng, progress = random.Random(seed), [0]
        while not stop.is_set():
            i = rng.randrange(len(jobs))
            results.append((i, stream_one(soak_mesh, jobs[i], progress, 0), time.monotonic()))

    pool = concurrent.futures.ThreadPoolExecutor(CLIENTS)
    futures = [pool.submit(client, seed) for seed in range(CLIENTS)]
    rng, restarts, struck = random.Random(7), [], []
    started = time.monotonic()
    rss_first = 0
    while time.monotonic() - started < SOAK_S:
        time.sleep(PERIOD_S)
        rss_first = rss_first or mesh_rss_kib(soak_mesh)
        fault = pick_fault(soak_mesh, rng)
        struck.append(fault)
        if fault == "nats":
            restarts.append(time.monotonic())
            own_nats.restart()
        else:
            os.kill(worker_pid(soak_mesh, fault), signal.SIGKILL)
    stop.set()
    hung = [f for f in futures if not _ended(f, timeout=120)]
    rss_last = mesh_rss_kib(soak_mesh)
    completed = [(i, o) for i, o, _ in results if not o.error]
    failed = [(o, t) for _, o, t in results if o.error]
    print(
        f"\nCHAOS soak {SOAK_S:.0f}s, faults {struck}: completed={len(completed)} "
        f"failed={len(failed)} hung={len(hung)} rss={rss_first}->{rss_last} KiB"
    )
    assert not hung
    assert [i for i, o in completed if o.text != expected[i]] == []
    unexplained = [o.error for o, t in failed if not any(0 <= t - r < 60 for r in restarts)]
    assert unexplained == []
    assert rss_last < 1.5 * rss_first


def _ended(future: concurrent.futures.Future, timeout: float) -> bool:
    try:
        future.result(timeout)
    except concurrent.futures.TimeoutError:
        return False
    return True
