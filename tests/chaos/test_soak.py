"""Issue 60, case 7: the soak (`make chaos`; `make chaos SOAK_S=600` for a shorter one).

A mixed load (greedy and seeded prompts of 40 to 145 tokens, streamed and not, from 4
clients) runs through `splitserve up` (2 prefill, 2 decode workers) on a 3-node NATS
cluster, with a second scheduler replica beside up's, for `SPLITSERVE_SOAK_S` seconds
(1800). Every `SPLITSERVE_SOAK_PERIOD_S` (60) seconds one random fault strikes: a worker
SIGKILLed (the launcher restarts it), one of the two scheduler replicas SIGKILLed (the
launcher restarts up's, the test the other a third of a period later), or a NATS node
SIGKILLed (restarted a third of a period later). Each request counts as completed (the
engine's own text, every token), wrong (another text), failed (an error), lost (its reply
ended without its tokens: an empty or cut-off 200) or hung (no answer within the client's
timeout of 120 s, or still open at the end). Checked: none wrong, failed, lost or hung;
every worker idle with its blocks free at the end; the RSS of every long-lived process,
sampled every 10 s, flat (soak.py says what that means).
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

from shared.nats_server import NatsServer, cluster_urls, start_nats_cluster
from tests.chaos.soak import MemoryLog, Proc, descendants, restart_node, scan
from tests.e2e.test_chaos import (
    Job,
    Outcome,
    assert_blocks_return,
    complete,
    make_jobs,
    reference,
    stream_one,
)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]
SOAK_S = float(os.environ.get("SPLITSERVE_SOAK_S", "1800"))
PERIOD_S = float(os.environ.get("SPLITSERVE_SOAK_PERIOD_S", "60"))
CLIENTS = 4
SAMPLE_S = 10.0
CLIENT_TIMEOUT_S = 120.0  # past the gateway's own limits (submit 90 s, stall 60 s): hung
VERDICTS = ("completed", "wrong", "failed", "lost", "hung")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[list[NatsServer]]:
    servers = start_nats_cluster(tmp_path_factory.mktemp("soak-cluster"))
    yield servers  # the soak replaces the nodes it restarts in place
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def soak_mesh(mesh_model_dir, tmp_path_factory, cluster) -> Iterator[Mesh]:  # noqa: F811
    home = tmp_path_factory.mktemp("chaos-soak")
    # 512 blocks a worker: 8 times what 4 clients' requests hold at most, so the machine's
    # memory goes to the processes under test rather than to empty KV pools (2 GiB each).
    flags = ["--prefill", "2", "--decode", "2", "--num-kv-blocks", "512"]
    flags += ["--nats", cluster_urls(cluster)]
    for mesh in start_mesh(mesh_model_dir, home, flags):
        mesh.nats_port = cluster[0].port
        yield mesh


def plain_one(mesh: Mesh, job: Job) -> Outcome:
    """One request without streaming."""
    try:
        reply = complete(mesh, job, CLIENT_TIMEOUT_S, stream=False)
    except openai.APIError as exc:
        return Outcome(error=str(exc) or type(exc).__name__)
    return Outcome(text=reply.choices[0].text, finish=reply.choices[0].finish_reason)


def verdict(outcome: Outcome, expected: str) -> str:
    if "timed out" in outcome.error.lower():
        return "hung"
    if outcome.error:
        return "failed"
    if outcome.finish != "length":
        return "lost"
    return "completed" if outcome.text == expected else "wrong"


class Faults:
    """Strikes one random worker, scheduler replica or NATS node at a time, and mends what
    the launcher does not restart (the test's own replica, a node)."""

    def __init__(self, mesh: Mesh, cluster: list[NatsServer], log_dir: str) -> None:
        self.mesh, self.cluster, self.log_dir = mesh, cluster, log_dir
        self.replica = self._start_replica()
        self.down: int | None = None  # the cluster index of a killed node

    def _start_replica(self) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, "scheduler-replica.log"), "ab")  # noqa: SIM115
        argv = [sys.executable, "-m", "services.cli", "scheduler"]
        argv += ["--nats", cluster_urls(self.cluster)]
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def watched(self, procs: dict[int, Proc]) -> dict[int, str]:
        """The long-lived processes: up and everything under it, the replica, the nodes."""
        found = descendants(procs, self.mesh.process.pid)
        found[self.replica.pid] = "scheduler replica"
        for node in self.cluster:
            found[node.process.pid] = f"nats {node.port}"
        return found

    def strike(self, rng: random.Random) -> str:
        mesh_pids = descendants(scan(), self.mesh.process.pid)
        targets = {name: pid for pid, name in mesh_pids.items() if name.startswith("worker ")}
        targets |= {name: pid for pid, name in mesh_pids.items() if name == "scheduler"}
        if self.replica.poll() is None:
            targets["scheduler replica"] = self.replica.pid
        if self.down is None:
            targets["nats node"] = 0
        name = rng.choice(sorted(targets))
        if name == "nats node":
            self.down = rng.randrange(len(self.cluster))
            node = self.cluster[self.down]
            node.process.send_signal(signal.SIGKILL)
            node.process.wait()
            self.mesh.nats_port = self.cluster[(self.down + 1) % len(self.cluster)].port
            return f"nats node {node.port}"
        os.kill(targets[name], signal.SIGKILL)
        return name

    def mend(self) -> None:
        if self.down is not None:
            self.cluster[self.down] = restart_node(self.cluster[self.down])
            self.down = None
        if self.replica.poll() is not None:
            self.replica = self._start_replica()

    def close(self) -> None:
        self.replica.kill()
        self.replica.wait()


@pytest.mark.timeout(SOAK_S + 900)  # past the run itself: start, the reference, the end
def test_soak_with_a_fault_every_period(soak_mesh, mesh_model_dir, cluster, tmp_path):  # noqa: F811
    jobs = make_jobs(71)
    expected = reference(mesh_model_dir, jobs)
    stop = threading.Event()
    results: list[tuple[int, Outcome]] = []

    def client(seed: int) -> None:
        rng, progress = random.Random(seed), [0]
        while not stop.is_set():
            i = rng.randrange(len(jobs))
            streamed = rng.random() < 0.5
            if streamed:
                outcome = stream_one(soak_mesh, jobs[i], progress, 0, CLIENT_TIMEOUT_S)
                results.append((i, outcome))
            else:
                results.append((i, plain_one(soak_mesh, jobs[i])))

    faults = Faults(soak_mesh, cluster, str(tmp_path))
    memory, rng, struck = MemoryLog(), random.Random(7), []
    pool = concurrent.futures.ThreadPoolExecutor(CLIENTS)
    futures = [pool.submit(client, seed) for seed in range(CLIENTS)]
    started = time.monotonic()
    next_sample, next_fault, mend_at = started, started + PERIOD_S, float("inf")
    try:
        while (now := time.monotonic()) - started < SOAK_S:
            if now >= next_sample:
                procs = scan()
                memory.sample(faults.watched(procs), procs)
                next_sample += SAMPLE_S
            if now >= mend_at:
                faults.mend()
                mend_at = float("inf")
            if now >= next_fault:
                struck.append(faults.strike(rng))
                mend_at, next_fault = now + PERIOD_S / 3, next_fault + PERIOD_S
            time.sleep(0.2)
        faults.mend()
        stop.set()
        open_at_end = sum(not _ended(f, timeout=120) for f in futures)
    finally:
        stop.set()
        faults.close()
    counts = Counter(verdict(o, expected[i]) for i, o in results)
    counts["hung"] += open_at_end
    figures = " ".join(f"{v}={counts[v]}" for v in VERDICTS)
    print(f"\nCHAOS soak {SOAK_S:.0f}s, {len(struck)} faults: {figures}")
    print(f"  faults: {dict(Counter(kind(name) for name in struck))}")
    judged = memory.judged()
    print(
        f"  rss: {len(memory.samples)} processes sampled, {len(judged)} lived long enough to judge"
    )
    for name, pid, start, end, flat in judged:
        growth = "flat" if flat else "GREW"
        print(f"  rss {name} ({pid}): {start / 1024:.0f} -> {end / 1024:.0f} MiB, {growth}")
    for _, outcome in results:
        if outcome.error:
            print(f"  error: {outcome.error}")
    assert [counts[v] for v in VERDICTS[1:]] == [0, 0, 0, 0], figures
    assert all(flat for *_, flat in judged), judged
    assert_blocks_return(soak_mesh, 4, timeout=60)


def kind(fault: str) -> str:
    """`worker`, `scheduler`, `scheduler replica` or `nats node`."""
    return next((k for k in ("worker", "nats node") if fault.startswith(k)), fault)


def _ended(future: concurrent.futures.Future, timeout: float) -> bool:
    try:
        future.result(timeout)
    except concurrent.futures.TimeoutError:
        return False
    return True
