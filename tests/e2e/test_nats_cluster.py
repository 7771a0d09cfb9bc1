"""The mesh over a real 3-node nats-server cluster on loopback (routes between the nodes),
every service given every node's URL (`--nats A,B,C`), clients spread over the nodes.
Under load: SIGKILL the node(s) the decode worker and the gateway are connected to → every
stream completes with the engine's own text, none hangs, and new requests sent right after
complete; two scheduler replicas on the submit queue group, SIGKILL one → no request lost
(the streams in flight and a second wave sent right after the kill all complete). Each test
prints a `CHAOS` line (completed / failed / hung) for the README's "Failure behaviour"
rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from shared.nats_server import NatsServer, cluster_urls, start_nats_cluster
from tests.e2e.test_chaos import (
    assert_blocks_return,
    assert_same_texts,
    make_jobs,
    reference,
    report,
    run_load,
)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STREAMS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[list[NatsServer]]:
    servers = start_nats_cluster(tmp_path_factory.mktemp("cluster"))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def spread(mesh_model_dir, tmp_path_factory, cluster) -> Iterator[Mesh]:  # noqa: F811
    """1 prefill + 1 decode + scheduler + gateway over the cluster; a stalled stream
    migrates after 5 s."""
    os.environ["SPLITSERVE_STALL_TIMEOUT"] = "5"
    try:
        home = tmp_path_factory.mktemp("cluster-home")
        for mesh in start_mesh(mesh_model_dir, home, ["--nats", cluster_urls(cluster)]):
            mesh.nats_port = cluster[0].port  # status queries: any live node
            yield mesh
    finally:
        os.environ.pop("SPLITSERVE_STALL_TIMEOUT")


def connections(server: NatsServer) -> list[str]:
    """The client names connected to this node."""
    url = f"http://127.0.0.1:{server.monitor_port}/connz?limit=1000"
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return [c.get("name", "") for c in json.loads(reply.read())["connections"] or []]
    except OSError:
        return []  # a killed node


def node_of(cluster: list[NatsServer], prefix: str) -> NatsServer:
    for server in cluster:
        if server.process.poll() is None and any(n.startswith(prefix) for n in connections(server)):
            return server
    raise AssertionError(f"no live node has a client named {prefix}*")


def live(cluster: list[NatsServer]) -> NatsServer:
    return next(s for s in cluster if s.process.poll() is None)


def test_killing_the_node_of_the_decode_worker_and_gateway(
    spread,
    cluster,
    mesh_model_dir,  # noqa: F811
):
    jobs = make_jobs(21)[:STREAMS]
    expected = reference(mesh_model_dir, jobs)
    doomed = {node_of(cluster, "worker-decode").port: node_of(cluster, "worker-decode")}
    doomed[node_of(cluster, "gateway").port] = node_of(cluster, "gateway")
    assert len(doomed) < len(cluster)

    def kill_nodes() -> None:
        for server in doomed.values():
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()

    outcomes = run_load(spread, jobs, kill_nodes, after_chunks=10)
    _, failed, hung = report(f"NATS node SIGKILL ({len(doomed)} of 3)", outcomes)
    assert (failed, hung) == (0, 0), [o.error for o in outcomes]
    assert all(o.finish == "length" for o in outcomes)
    assert_same_texts(jobs, outcomes, expected)
    # sent as the in-flight streams end: the scheduler may still be on its way to a live
    # node, and the gateway asks again until it is (scheduler_grace)
    after = run_load(spread, make_jobs(24)[:STREAMS], lambda: None, after_chunks=0)
    done, failed, hung = report("new requests right after the NATS node SIGKILL", after)
    assert (done, failed, hung) == (STREAMS, 0, 0), [o.error for o in after]
    spread.nats_port = live(cluster).port
    assert_blocks_return(spread, 2)


def test_killing_one_of_two_scheduler_replicas_loses_no_request(spread, cluster, tmp_path):
    urls = ",".join(s.url for s in cluster if s.process.poll() is None)
    log = (tmp_path / "scheduler-2.log").open("w")
    replica = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "scheduler", "--nats", urls],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while sum(n == "scheduler" for s in cluster for n in connections(s)) < 2:
            assert replica.poll() is None and time.monotonic() < deadline, "replica not up"
            time.sleep(0.2)
        time.sleep(2)  # its registry fills from heartbeats (1 s apart)
        jobs = make_jobs(22)[:STREAMS]
        kill = lambda: os.kill(replica.pid, signal.SIGKILL)  # noqa: E731
        outcomes = run_load(spread, jobs, kill, after_chunks=10)
        after = run_load(spread, make_jobs(23)[:STREAMS], lambda: None, after_chunks=0)
    finally:
        if replica.poll() is None:
            replica.kill()
        replica.wait()
    done, failed, hung = report("scheduler replica SIGKILL (of 2)", outcomes + after)
    assert (failed, hung) == (0, 0), [o.error for o in outcomes + after]
    assert done == 2 * STREAMS
