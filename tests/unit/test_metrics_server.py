"""`serve_metrics`: one port answers `/metrics` (the registry), `/health` (liveness) and
`/ready` (readiness, from a callable); anything else is 404."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from shared.telemetry.metrics import SchedulerMetrics, serve_metrics


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_health_ready_and_404() -> None:
    metrics = SchedulerMetrics()
    metrics.waiting.set(3)
    serving = {"ready": True}
    port = serve_metrics(metrics.registry, 0, "127.0.0.1", ready=lambda: serving["ready"])
    assert port > 0

    status, body = get(port, "/metrics")
    assert status == 200
    assert "splitserve_num_requests_waiting 3.0" in body

    assert get(port, "/health") == (200, "ok\n")
    assert get(port, "/ready")[0] == 200

    serving["ready"] = False  # e.g. a worker that got SIGTERM and drains
    assert get(port, "/ready")[0] == 503
    assert get(port, "/health")[0] == 200  # still alive: the drain must not be killed

    serving["ready"] = True
    assert get(port, "/ready")[0] == 200

    assert get(port, "/")[0] == 404
    assert get(port, "/nope")[0] == 404


def test_ready_by_default() -> None:
    port = serve_metrics(CollectorRegistry(), 0, "127.0.0.1")
    assert get(port, "/ready")[0] == 200
    assert get(port, "/metrics")[0] == 200
