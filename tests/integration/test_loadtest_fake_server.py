"""The harness against a fake OpenAI SSE server with scripted timings (loopback, no model):
measured TTFT/TPOT/ITL/E2EL equal the script, arrivals follow the requested rate, errors
are counted by kind, closed-loop users follow their weights and run time, and the CLI
writes its JSON and PNG."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from loadtest.cli import main
from loadtest.client import ClientConfig
from loadtest.fake_server import FakeServer, Script
from loadtest.metrics import summarize
from loadtest.openloop import OpenLoopConfig, RunResult, run_open_loop
from loadtest.report import run_from_json
from loadtest.request import BenchRequest
from loadtest.users import Task, UserClass, UsersConfig, constant, run_users

T = TypeVar("T")
TOL_MS = 8.0  # scheduling slack of a busy 2-core machine, per measured interval


def with_server(script: Script, body: Callable[[FakeServer, str], Awaitable[T]]) -> T:
    async def go() -> T:
        server = FakeServer(script)
        url = await server.start()
        try:
            return await body(server, url)
        finally:
            await server.stop()

    return asyncio.run(go())


def open_loop(reqs: list[BenchRequest], endpoint: str = "completions", **kw: float) -> Callable:
    async def body(server: FakeServer, url: str) -> tuple[RunResult, list[float]]:
        client = ClientConfig(url, "fake-model", endpoint, timeout_s=kw.pop("timeout", 30.0))
        cfg = OpenLoopConfig(show_progress=False, **kw)  # type: ignore[arg-type]
        return await run_open_loop(client, cfg, reqs), server.received

    return body


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_metrics_equal_scripted_timings(endpoint: str) -> None:
    script = Script(ttft_s=0.08, itl_s=0.02, tokens_per_chunk=2)
    reqs = [BenchRequest("hello " * 8, 12, 10) for _ in range(4)]
    run, _ = with_server(script, open_loop(reqs, endpoint, max_concurrency=1))
    s = summarize(run.records, run.duration)
    assert s.completed == 4 and s.failed == 0
    assert s.total_output_tokens == 40  # from usage, though only 5 chunks a request
    assert s.total_input_tokens == 4 * 12  # the fake counts len(text) // 4
    assert s.ttft.median == pytest.approx(80, abs=TOL_MS)
    assert s.itl.median == pytest.approx(20, abs=TOL_MS)  # 4 gaps between 5 chunks
    assert s.e2el.median == pytest.approx(80 + 4 * 20, abs=2 * TOL_MS)
    assert s.tpot.median == pytest.approx(4 * 20 / 9, abs=TOL_MS / 4)  # per token
    assert s.max_concurrency_seen == 1


def test_arrivals_follow_rate() -> None:
    reqs = [BenchRequest([101, 102], 2, 1) for _ in range(60)]
    script = Script(ttft_s=0.0, itl_s=0.0)
    _, received = with_server(script, open_loop(reqs, request_rate=40.0, seed=3))
    gaps = np.diff(received)
    assert received[-1] - received[0] == pytest.approx(59 / 40, rel=0.35)
    assert gaps.mean() == pytest.approx(1 / 40, rel=0.35)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.4)  # Poisson


def test_errors_counted_by_kind() -> None:
    prompts = ["ok", "fail:429", "fail:stream", "fail:hang", "ok"]
    reqs = [BenchRequest(p, 1, 3) for p in prompts]
    run, _ = with_server(Script(0.01, 0.01), open_loop(reqs, timeout=0.5))
    s = summarize(run.records, run.duration)
    assert s.completed == 2
    assert s.errors == {"http_429": 1, "stream_error": 1, "timeout": 1}
    assert "busy" in s.error_examples["http_429"]
    assert "worker lost" in s.error_examples["stream_error"]


def test_users_follow_weights_and_run_time() -> None:
    def make(label: str) -> Callable:
        return lambda rng: BenchRequest("hi", 1, 2, label=label)

    scenario = (
        UserClass("a", (Task("a1", make("a1"), 3), Task("a2", make("a2"), 1)), constant(0.0), 3),
        UserClass("b", (Task("b", make("b")),), constant(0.05), 1),
    )

    async def body(server: FakeServer, url: str) -> RunResult:
        cfg = UsersConfig(users=4, spawn_rate=100, run_time_s=1.0, show_progress=False)
        return await run_users(ClientConfig(url, "fake-model", "chat"), cfg, scenario)

    run = with_server(Script(0.01, 0.005), body)
    labels = [r.label for r in run.records]
    assert all(r.ok for r in run.records)
    assert 1.0 <= run.duration < 1.3
    # 3 of 4 users are class a; its tasks split 3 : 1
    assert labels.count("a1") / (labels.count("a1") + labels.count("a2")) == pytest.approx(
        0.75, abs=0.1
    )
    assert 0 < labels.count("b") < labels.count("a1") / 3


def test_cli_writes_json_and_png(tmp_path: Path) -> None:

    async def body(server: FakeServer, url: str) -> None:
        args = ["serve", "--host", url, "--num-prompts", "6", "--output-len", "4",
                "--max-concurrency", "2", "--slo", "ttft=1s", "--out", str(tmp_path),
                "--label", "t", "--no-progress"]  # fmt: skip
        await asyncio.to_thread(main, args)

    with_server(Script(0.01, 0.005), body)
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["config"]["client"]["model"] == "fake-model"  # from GET /v1/models
    assert result["summary"]["completed"] == 6 and result["summary"]["goodput"] > 0
    assert len(result["requests"]) == 6
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    # the result file holds the whole run: the same figures come back from it
    rebuilt = run_from_json(result)
    again = summarize(rebuilt.records, rebuilt.duration)
    assert again.ttft.mean == pytest.approx(result["summary"]["ttft"]["mean"])
    assert again.itl.p99 == pytest.approx(result["summary"]["itl"]["p99"])
    assert again.total_output_tokens == result["summary"]["total_output_tokens"]
    main(["plot", str(tmp_path / "t.json"), "--png", str(tmp_path / "again.png")])
    assert (tmp_path / "again.png").read_bytes()[:4] == b"\x89PNG"
