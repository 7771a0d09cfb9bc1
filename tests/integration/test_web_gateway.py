"""The gateway's browser-facing HTTP: CORS, SSE heartbeats, the pages and /v1/mesh/status.

A real nats-server and a fake scheduler (written here with `Bus`) that answers StatusQuery
and accepts every SubmitRequest without ever sending a token, so streams stay silent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from services.gateway.app import create_runner
from services.gateway.config import GatewayConfig
from shared.bus import Bus
from shared.config import CommonConfig
from shared.engine.startup_phases import StartupPhase
from shared.kv_tier_messages import TierCounters
from shared.nats_server import NatsServer
from shared.planner_messages import PlannerReport, ReportedDecision
from shared.ports import free_port
from shared.prefix_messages import PeerReadCounters
from shared.protocol import (
    Cancel,
    Heartbeat,
    KVPeer,
    MeshStatus,
    Outcome,
    StatusQuery,
    SubmitAck,
    SubmitRequest,
    WorkerStatus,
)
from shared.startup_messages import PhaseTime
from shared.subjects import Subjects
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e
NAMESPACE = "webtest"
MODEL = "smol"
ALLOWED = "http://127.0.0.1:5555"
CHAT = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
# p0 sent KV to d1 over NATS (d1 cannot load NIXL), then to d0 by NIXL.
BEATS = [
    Heartbeat(
        "p0",
        "prefill",
        MODEL,
        1,
        2,
        90,
        100,
        16,
        kv_blocks_sent=13,
        kv_transports=["nixl", "nats"],
        kv_peers=[KVPeer("d1", "nats", 4, 1), KVPeer("d0", "nixl", 9, 3)],
    ),
    Heartbeat(
        "d0",
        "decode",
        MODEL,
        3,
        0,
        25,
        100,
        16,
        draining=True,
        prefix_queries=400,
        startup=[PhaseTime(StartupPhase.WEIGHTS_LOAD, 1.25)],
        ready_s=2.5,
        prefix_hits=100,
        kv_blocks_received=9,
        kv_transports=["nixl", "nats"],
        kv_tier=TierCounters(capacity_bytes=1 << 30, stored_bytes=4096, hits=7, load_seconds=0.5),
        kv_peer_reads=PeerReadCounters(5, 1000, 0.25, [0, 2], 3),
    ),
    Heartbeat("d1", "decode", MODEL, 0, 0, 100, 100, 16, kv_transports=["nats"]),
]
PLANNED = [
    ReportedDecision(100.0, "add", "tpot_over_slo", "decode", "", "TPOT p99 60 ms", "target 1"),
    ReportedDecision(200.0, "drain", "prefill_idle", "prefill", "p1", "prefill busy 3%", "ok"),
]
REPORT = PlannerReport(
    "planner", 7, 250.0, "replicas", "", 1.0, 0.04, 1, 2, 0, 0.4, 0.03, "cooling down", PLANNED
)


@asynccontextmanager
async def gateway(nats: NatsServer, model_dir: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """A gateway (CORS for ALLOWED, 0.2 s heartbeats) and a silent fake scheduler; yields
    the gateway's URL and the ids of the requests cancelled so far."""
    subjects, cancelled = Subjects(NAMESPACE), []
    bus = await Bus.connect(nats.url, "fake-scheduler")

    async def status(query: StatusQuery, headers: dict) -> MeshStatus:
        workers = [WorkerStatus(b, time.time(), ["r1"]) for b in BEATS]
        return MeshStatus(workers, 4, 7, 1, REPORT)

    async def submit(request: SubmitRequest, headers: dict) -> SubmitAck:
        return SubmitAck(request.request_id, Outcome.OK, prefill_worker="p0", decode_worker="d0")

    async def cancel(message: Cancel, headers: dict) -> None:
        cancelled.append(message.request_id)

    await bus.serve(subjects.status, StatusQuery, status, lambda _: None)
    await bus.serve(
        subjects.submit, SubmitRequest, submit, lambda _: SubmitAck("", Outcome.INVALID)
    )
    await bus.subscribe(subjects.cancel, Cancel, cancel)
    config = GatewayConfig(
        common=CommonConfig(nats.url, NAMESPACE, "INFO"),
        model_dir=model_dir,
        served_model_name=MODEL,
        gateway_id="gw-web",
        max_model_len=128,
        port=free_port(),
        cors_origins=(ALLOWED,),
        sse_heartbeat=0.2,
    )
    runner = create_runner(config)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    try:
        yield f"http://127.0.0.1:{config.port}", cancelled
    finally:
        await runner.cleanup()
        await bus.close()


def test_preflight_allows_only_the_configured_origin(nats_server, real_model_dir):  # noqa: F811
    async def scenario() -> None:
        async with (
            gateway(nats_server, real_model_dir) as (url, _),
            aiohttp.ClientSession() as http,
        ):
            asked = {
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
            }
            path = url + "/v1/chat/completions"
            async with http.options(path, headers={"Origin": ALLOWED, **asked}) as reply:
                assert reply.status == 204
                assert reply.headers["Access-Control-Allow-Origin"] == ALLOWED
                assert "POST" in reply.headers["Access-Control-Allow-Methods"]
                allowed = reply.headers["Access-Control-Allow-Headers"].lower()
                assert all(h in allowed for h in ("authorization", "content-type", "x-stainless"))
                assert "Access-Control-Allow-Credentials" not in reply.headers
            other = {"Origin": "http://127.0.0.1:6666", **asked}
            async with http.options(path, headers=other) as reply:
                assert reply.status == 403
                assert "Access-Control-Allow-Origin" not in reply.headers
            async with http.get(url + "/v1/models", headers={"Origin": ALLOWED}) as reply:
                assert reply.headers["Access-Control-Allow-Origin"] == ALLOWED
            async with http.get(url + "/v1/models", headers=other) as reply:
                assert reply.status == 200 and "Access-Control-Allow-Origin" not in reply.headers

    asyncio.run(scenario())


def test_silent_stream_gets_heartbeats_and_cors_then_cancels(nats_server, real_model_dir):  # noqa: F811
    async def scenario() -> None:
        async with gateway(nats_server, real_model_dir) as (url, cancelled):
            async with aiohttp.ClientSession() as http:
                path = url + "/v1/chat/completions"
                async with http.post(path, json=CHAT, headers={"Origin": ALLOWED}) as reply:
                    assert reply.headers["Content-Type"].startswith("text/event-stream")
                    assert reply.headers["Cache-Control"] == "no-cache"
                    assert reply.headers["X-Accel-Buffering"] == "no"
                    assert reply.headers["Access-Control-Allow-Origin"] == ALLOWED
                    lines = [await reply.content.readline() for _ in range(4)]
                    assert lines == [b": keep-alive\n", b"\n"] * 2
            # The client went away: the gateway cancels the request on the mesh.
            for _ in range(50):
                if cancelled:
                    break
                await asyncio.sleep(0.1)
            assert len(cancelled) == 1

    asyncio.run(scenario())


def test_pages_and_mesh_status(nats_server, real_model_dir):  # noqa: F811
    async def scenario() -> None:
        async with (
            gateway(nats_server, real_model_dir) as (url, _),
            aiohttp.ClientSession() as http,
        ):
            for path, marker in (
                ("/", "playground.js"),
                ("/mesh", "mesh.js"),
                ("/static/sse.js", "sseEvents"),
                ("/static/style.css", ".message"),
            ):
                async with http.get(url + path) as reply:
                    assert reply.status == 200 and marker in await reply.text(), path
            async with http.get(url + "/v1/mesh/status") as reply:
                body = await reply.json()
        assert body["scheduler"] == {"queue_length": 4, "admitted": 7, "rejected": 1}
        workers = {w["id"]: w for w in body["workers"]}
        assert workers["d0"] | {"last_seen": 0} == {
            "id": "d0",
            "model": MODEL,
            "role": "decode",
            "state": "draining",
            "running": 3,
            "waiting": 0,
            "free_blocks": 25,
            "total_blocks": 100,
            "block_size": 16,
            "kv_usage": 0.75,
            "kv_blocks_sent": 0,
            "kv_blocks_received": 9,
            "prefix_hit_rate": 0.25,
            "assigned": 1,
            "last_seen": 0,
            "kv_transports": ["nixl", "nats"],
            "kv_peers": [],
            "kv_tier": {
                **asdict(TierCounters()),
                "capacity_bytes": 1 << 30,
                "stored_bytes": 4096,
                "hits": 7,
                "load_seconds": 0.5,
            },
            "kv_peer_reads": {  # prefix blocks read from other workers, fallbacks by reason
                "blocks": 5,
                "bytes": 1000,
                "seconds": 0.25,
                "fallbacks": {"no_transport": 0, "not_worth": 2},
                "pinned_for_peers": 3,
            },
            "ready_s": 2.5,
            "startup": {"weights_load": 1.25},
        }
        assert (workers["p0"]["state"], workers["p0"]["waiting"]) == ("ready", 2)
        # Each pair the prefill worker sent KV to, by decode worker id, with its transport.
        assert workers["p0"]["kv_peers"] == [
            {"worker_id": "d0", "transport": "nixl", "blocks": 9, "transfers": 3},
            {"worker_id": "d1", "transport": "nats", "blocks": 4, "transfers": 1},
        ]
        assert workers["d1"]["kv_transports"] == ["nats"]
        assert [w["id"] for w in body["workers"]] == ["d0", "d1", "p0"]  # model, role, id
        assert body["gateway"]["history"] == [] and body["gateway"]["requests_running"] == 0
        # The planner's report: objectives, p99s, the counts it wants, decisions newest first.
        planner = body["planner"]
        assert (planner["id"], planner["mode"], planner["holding"]) == (
            "planner", "replicas", "cooling down",
        )  # fmt: skip
        assert planner["slo"] == {"ttft_s": 1.0, "tpot_s": 0.04}
        assert planner["p99"] == {"ttft_s": 0.4, "tpot_s": 0.03}
        assert planner["desired"] == {"prefill": 1, "decode": 2, "both": 0}
        assert [(d["action"], d["worker_id"], d["outcome"]) for d in planner["decisions"]] == [
            ("drain", "p1", "ok"),
            ("add", "", "target 1"),
        ]

    asyncio.run(scenario())
