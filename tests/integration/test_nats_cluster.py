"""A 3-node nats-server cluster on loopback (routes between every pair): a `Bus` given
every node's URL fails over when the node it is connected to is SIGKILLed, and
request/reply between clients on different nodes goes on within seconds."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import nats
import pytest

from shared.bus import Bus
from shared.nats_server import cluster_urls, start_nats_cluster
from shared.protocol import Cancel, Outcome, TaskAck


@pytest.fixture
def cluster(tmp_path):
    servers = start_nats_cluster(tmp_path)
    yield servers
    for server in servers:
        server.stop()


def peers(server) -> set[str]:
    """The nodes `server` has routes to (several connections each: route pooling)."""
    url = f"http://127.0.0.1:{server.monitor_port}/routez"
    with urllib.request.urlopen(url, timeout=2) as reply:
        return {route["remote_name"] for route in json.loads(reply.read())["routes"] or []}


def test_a_bus_fails_over_when_its_node_is_killed(cluster) -> None:
    deadline = time.monotonic() + 10
    while not all(len(peers(s)) == 2 for s in cluster):  # a full mesh of routes
        assert time.monotonic() < deadline, "routes did not form"
        time.sleep(0.1)
    urls = cluster_urls(cluster)

    async def main() -> tuple[int, float]:
        worker = await Bus.connect(urls, "worker")
        gateway = await Bus.connect(urls, "gateway")

        async def answer(cancel: Cancel, headers) -> TaskAck:
            return TaskAck(cancel.request_id, Outcome.OK)

        await worker.serve("t.work", Cancel, answer, lambda why: TaskAck("", Outcome.INVALID, why))
        await worker.nc.flush()
        # The flush reaches the worker's node only; the other nodes learn of the
        # subscription over their routes a moment later (until then: no responders).
        ask_until = time.monotonic() + 10
        while True:
            try:
                first = await gateway.request("t.work", Cancel("r0"), TaskAck, 2)
                break
            except nats.errors.NoRespondersError:
                assert time.monotonic() < ask_until, "the subscription never spread"
                await asyncio.sleep(0.05)
        assert first.ok
        node = next(s for s in cluster if s.url == worker.nc.connected_url.geturl())
        node.process.send_signal(signal.SIGKILL)
        node.process.wait()
        killed_at, answered = time.monotonic(), 0
        for i in range(1, 40):  # keep asking: the first answers may be lost in the switch
            try:
                reply = await gateway.request("t.work", Cancel(f"r{i}"), TaskAck, 0.5)
            except Exception:
                await asyncio.sleep(0.1)
                continue
            assert reply.request_id == f"r{i}"
            answered += 1
            if answered == 5:
                break
        recovered = time.monotonic() - killed_at
        assert worker.nc.connected_url.geturl() != node.url
        await worker.close()
        await gateway.close()
        return answered, recovered

    answered, recovered = asyncio.run(main())
    assert answered == 5
    assert recovered < 10, f"took {recovered:.1f}s to answer again"
