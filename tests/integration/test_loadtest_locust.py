"""loadtest/locustfile.py under real Locust (headless) against the fake SSE server:
requests succeed and TTFT/TPOT arrive as custom events with the scripted values."""

from __future__ import annotations

import asyncio
import csv
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from loadtest.fake_server import FakeServer, Script

# Only look for locust: importing it here would monkey-patch this process with gevent.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust not installed"),
]


def test_locustfile_records_ttft_and_tpot(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    server = FakeServer(Script(ttft_s=0.1, itl_s=0.01))
    url = loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless",
             "--host", url, "-u", "2", "-r", "2", "-t", "4s", "--csv", str(tmp_path / "run"),
             "--only-summary", "ChatUser"],
            check=True, timeout=60, capture_output=True,
        )  # fmt: skip
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    with (tmp_path / "run_stats.csv").open() as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(rows[("POST", "chat")]["Failure Count"]) == 0
    assert int(rows[("POST", "chat")]["Request Count"]) >= 2
    assert float(rows[("TTFT", "chat")]["Median Response Time"]) == pytest.approx(100, abs=30)
    assert float(rows[("TPOT", "chat")]["Average Response Time"]) == pytest.approx(10, abs=5)
