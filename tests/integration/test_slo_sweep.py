"""`splitserve bench slo` end to end against scripted OpenAI servers (loadtest/fake_server.py,
loopback, no model): every configuration is started once and stopped, each gets the same
requests, and the JSON holds every point's attainment (failed requests missing) and each
configuration's goodput and goodput per core; the table and the PNG are written too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from loadtest.fake_server import FakeServer, Script
from loadtest.peers.servers import ServerCommand
from loadtest.slo.cli import config_from_args
from loadtest.slo.config import Configuration
from loadtest.slo.report import format_tables, write_results
from loadtest.slo.servers import taskset_command
from loadtest.slo.sweep import goodputs, run_sweep
from services.cli import build_parser

QUICK = Script(ttft_s=0.01, itl_s=0.0, tokens_per_chunk=64)  # TPOT ≈ 0
SLOW = Script(ttft_s=0.4, itl_s=0.0, tokens_per_chunk=64)  # misses a 200 ms TTFT


class FailsHalfTheLongOnes(FakeServer):
    """Answers 429 to every second request that wants 128 tokens (the long workload)."""

    def __init__(self) -> None:
        super().__init__(QUICK)
        self.long_seen = 0
        self.prompts: list[tuple[int, ...]] = []

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(tuple(body["prompt"]))
        if body["max_tokens"] == 128:
            self.long_seen += 1
            if self.long_seen % 2 == 0:
                return web.json_response({"error": {"message": "busy"}}, status=429)
        return await super()._complete(request)


class FakeServers:
    """Starts a scripted server per configuration, by name; records starts and stops."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.prompts: dict[str, set[tuple[int, ...]]] = {}
        self._server: FakeServer | None = None

    async def start(self, config: Configuration) -> str:
        self.events.append(f"start {config.name}")
        if config.name == "flaky":
            self._server = FailsHalfTheLongOnes()
        else:
            self._server = FakeServer(SLOW if config.name == "slow" else QUICK)
        return await self._server.start()

    async def stop(self) -> None:
        assert self._server is not None
        if isinstance(self._server, FailsHalfTheLongOnes):
            self.prompts["flaky"] = set(self._server.prompts)
        await self._server.stop()
        self.events.append("stop")


def test_the_sweep_reports_attainment_and_goodput_per_configuration(tmp_path: Path) -> None:
    argv = ["bench", "slo", "--configs", "quick=both:0;slow=both:0;flaky=prefill:0,decode:1",
            "--workloads", "long,agent", "--rates", "40,20", "--num-prompts", "4",
            "--slo", "ttft=200ms,tpot=40ms", "--out", str(tmp_path)]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv))
    servers = FakeServers()
    lines: list[str] = []
    points = asyncio.run(run_sweep(cfg, servers, vocab_size=500, say=lines.append))
    assert servers.events == ["start quick", "stop", "start slow", "stop", "start flaky", "stop"]
    found = goodputs(points, cfg.rows, cfg.attainment)
    json_path, png_path = write_results(cfg, points, found)
    assert png_path.stat().st_size > 0
    result = json.loads(json_path.read_text())
    assert result["slo"] == {"ttft_s": 0.2, "tpot_s": 0.04}
    assert (result["attainment_target"], result["rates"]) == (0.9, [20.0, 40.0])
    costs = {c["name"]: c["cost"] for c in result["configurations"]}
    assert costs == {"quick": 1, "slow": 1, "flaky": 2}
    shares = {(p["configuration"], p["workload"], p["rate"]): p for p in result["points"]}
    assert len(shares) == len(result["points"]) == 3 * 2 * 2
    for (config, workload, _), p in shares.items():
        assert p["requests"] == 4
        expected = {"quick": 1.0, "slow": 0.0, "flaky": 0.5 if workload == "long" else 1.0}
        assert p["attainment"] == expected[config], (config, workload, p)
        assert p["met"] == round(4 * p["attainment"])
        flaky_long = (config, workload) == ("flaky", "long")
        assert p["errors"] == ({"http_429": 2} if flaky_long else {})
        assert p["completed"] == (2 if flaky_long else 4)
    by_row = {(g["configuration"], g["workload"]): g for g in result["goodput"]}
    assert by_row["quick", "long"]["goodput"] == by_row["quick", "agent"]["goodput"] == 40.0
    assert by_row["slow", "long"]["goodput"] == by_row["slow", "agent"]["goodput"] == 0.0
    assert by_row["flaky", "long"]["goodput"] == 0.0
    flaky = by_row["flaky", "agent"]
    assert (flaky["goodput"], flaky["per_core"]) == (40.0, 20.0)
    # Each rate sends prompts of its own: none repeats within the flaky server's run.
    assert len(servers.prompts["flaky"]) == 2 + 2 * 2 * 4  # warm-up + workloads × rates × 4
    table = format_tables(cfg, points, found)
    assert "flaky" in table and "50%" in table and len(lines) == 3 + 12


def test_a_vllm_row_runs_under_taskset_on_its_cores() -> None:
    command = ServerCommand(["python", "-m", "vllm"], {"OMP_NUM_THREADS": "2"}, "/health")
    pinned = taskset_command(command, (0, 1, 3))
    assert pinned.argv == ["taskset", "-c", "0-1,3", "python", "-m", "vllm"]
    assert (pinned.env, pinned.ready_path) == (command.env, "/health")
