"""The gateway's web pages and the JSON behind the live mesh view.

- `/`            the playground (static/index.html): chat with streamed answers.
- `/mesh`        the live mesh view (static/mesh.html), polling `/v1/mesh/status`.
- `/static/...`  their scripts and styles; plain files, no build step, nothing from a CDN.
- `/v1/mesh/status`  the scheduler's `MeshStatus` (asked over the gateway's NATS connection,
  as /ready does) as JSON, plus this gateway's recent history: every `SAMPLE_S` seconds
  a background task turns its metrics into the mean time to first token and the tokens
  per second delivered in that interval, and keeps `HISTORY_S` seconds of them for the
  page's sparklines (so a freshly opened page shows the last minutes at once).
  Each worker carries the KV transports it can use (`kv_transports`, best first) and, on
  the prefill side, one entry per decode worker it sent KV to (`kv_peers`: the transport
  it used last, blocks and transfers since start): the page draws these as pairs.
  `planner` is the planner's last report (null without one): its objectives, the workers
  it wants of each role, why it holds, and its recent decisions, newest first.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.keys import CLIENT
from shared.planner_messages import PlannerReport
from shared.prefix_messages import by_reason
from shared.protocol import KVPeer, MeshStatus, StatusQuery, WorkerStatus
from shared.telemetry.metrics import GatewayMetrics

STATIC = Path(__file__).parent / "static"
STATUS_TIMEOUT_S = 2.0
SAMPLE_S = 2.0
HISTORY_S = 300.0


@dataclass(frozen=True, slots=True)
class Totals:
    """The gateway's counters at one moment."""

    time: float
    ttft_sum: float  # seconds, over all requests so far
    ttft_count: float
    tokens: float
    running: float

    @classmethod
    def read(cls, metrics: GatewayMetrics) -> Totals:
        def value(name: str) -> float:
            return metrics.registry.get_sample_value(f"splitserve_{name}") or 0.0

        return cls(
            time.time(),
            value("time_to_first_token_seconds_sum"),
            value("time_to_first_token_seconds_count"),
            value("generation_tokens_total"),
            value("num_requests_running"),
        )

    def since(self, before: Totals) -> dict[str, float | None]:
        """One sparkline point: mean TTFT (None without new requests) and tokens/s."""
        requests = self.ttft_count - before.ttft_count
        ttft = (self.ttft_sum - before.ttft_sum) / requests if requests else None
        rate = (self.tokens - before.tokens) / max(self.time - before.time, 1e-9)
        return {
            "time": self.time,
            "ttft_ms": None if ttft is None else ttft * 1000,
            "tokens_per_s": rate,
        }


HISTORY = web.AppKey("web_history", deque)


def setup_pages(app: web.Application) -> None:
    app.router.add_get("/", _page("index.html"))
    app.router.add_get("/mesh", _page("mesh.html"))
    app.router.add_static("/static", STATIC)
    app.router.add_get("/v1/mesh/status", mesh_status)
    app.cleanup_ctx.append(_record_history)  # after the mesh connection (app.py)


async def _record_history(app: web.Application) -> AsyncIterator[None]:
    history: deque[dict[str, float | None]] = deque(maxlen=int(HISTORY_S / SAMPLE_S))
    app[HISTORY] = history

    async def sample() -> None:
        before = Totals.read(app[CLIENT].metrics)
        while True:
            await asyncio.sleep(SAMPLE_S)
            now = Totals.read(app[CLIENT].metrics)
            history.append(now.since(before))
            before = now

    task = asyncio.create_task(sample())
    yield
    task.cancel()


def _page(name: str) -> Callable[[web.Request], Awaitable[web.FileResponse]]:
    async def serve(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})

    return serve


async def mesh_status(request: web.Request) -> web.Response:
    client = request.app[CLIENT]
    try:
        status = await client.bus.request(
            client.subjects.status, StatusQuery(), MeshStatus, timeout=STATUS_TIMEOUT_S
        )
    except Exception as exc:
        raise ApiError(503, f"the scheduler did not answer: {exc!r}", retry_after=1) from None
    body = {
        "time": time.time(),
        "workers": [_worker(w) for w in sorted(status.workers, key=_order)],
        "scheduler": {
            "queue_length": status.queue_length,
            "admitted": status.admitted,
            "rejected": status.rejected,
        },
        "planner": _planner(status.planner) if status.planner else None,
        "gateway": {
            "requests_running": Totals.read(client.metrics).running,
            "sample_seconds": SAMPLE_S,
            "history": list(request.app[HISTORY]),
        },
    }
    return web.json_response(body, headers={"Cache-Control": "no-cache"})


def _order(worker: WorkerStatus) -> tuple[str, str, str]:
    """By model (the mesh view groups them), then role, then id."""
    return worker.heartbeat.model, worker.heartbeat.role, worker.heartbeat.worker_id


def _worker(worker: WorkerStatus) -> dict[str, Any]:
    beat = worker.heartbeat
    used = beat.total_blocks - beat.free_blocks
    return {
        "id": beat.worker_id,
        "model": beat.model,
        "role": beat.role,
        "state": "draining" if beat.draining else "ready",
        "running": beat.num_running,
        "waiting": beat.num_waiting,
        "free_blocks": beat.free_blocks,
        "total_blocks": beat.total_blocks,
        "block_size": beat.block_size,
        "kv_usage": used / beat.total_blocks if beat.total_blocks else 0.0,
        "kv_blocks_sent": beat.kv_blocks_sent,
        "kv_blocks_received": beat.kv_blocks_received,
        "prefix_hit_rate": beat.prefix_hits / beat.prefix_queries if beat.prefix_queries else 0.0,
        "assigned": len(worker.assigned),
        "last_seen": worker.last_seen,
        "kv_transports": list(beat.kv_transports),
        "kv_peers": [_peer(p) for p in sorted(beat.kv_peers, key=lambda p: p.worker_id)],
        "kv_tier": asdict(beat.kv_tier),  # its second KV tier (docs/kv_tier.md)
        "kv_peer_reads": asdict(beat.kv_peer_reads) | {"fallbacks": by_reason(beat.kv_peer_reads)},
        "ready_s": beat.ready_s,  # its start: process start → serving
        "startup": {p.phase.name.lower(): p.seconds for p in beat.startup},
    }


def _peer(peer: KVPeer) -> dict[str, Any]:
    return {
        "worker_id": peer.worker_id,
        "transport": peer.transport,
        "blocks": peer.blocks,
        "transfers": peer.transfers,
    }


def _planner(report: PlannerReport) -> dict[str, Any]:
    return {
        "id": report.planner_id,
        "time": report.time,
        "mode": report.mode,
        "model": report.model,
        "slo": {"ttft_s": report.ttft_slo, "tpot_s": report.tpot_slo},
        "p99": {"ttft_s": report.ttft_p99, "tpot_s": report.tpot_p99},
        "desired": {"prefill": report.prefill, "decode": report.decode, "both": report.both},
        "holding": report.holding,
        "decisions": [
            {
                "time": d.time,
                "action": d.action,
                "reason": d.reason,
                "role": d.role,
                "worker_id": d.worker_id,
                "detail": d.detail,
                "outcome": d.outcome,
            }
            for d in reversed(report.decisions)
        ],
    }
