"""`splitserve bench isolation` end to end against scripted OpenAI servers (loopback, no
model): a server whose streams stall while a one-token prompt is being answered shows the
stall in the burst window's gaps and not in the quiet one's; one that does not stall shows
a ratio near 1; each configuration is started and stopped once."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from loadtest.fake_server import FakeServer, Script
from loadtest.slo.config import Configuration, parse_configs
from loadtest.slo.isolation import IsolationConfig, run_isolation

STEADY = Script(ttft_s=0.6, itl_s=0.01)


class StallingOnBurst(FakeServer):
    """Streams' chunks come every 250 ms instead of 10 while a one-token (burst) prompt is
    being answered: the interference of an aggregated worker's prefill."""

    def __init__(self) -> None:
        super().__init__(STEADY)
        self.busy_until = 0.0

    def gap(self) -> float:
        return 0.25 if time.monotonic() < self.busy_until else self.script.itl_s

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        if (await request.json())["max_tokens"] == 1:  # aiohttp keeps the body: read again
            self.busy_until = max(self.busy_until, time.monotonic() + self.script.ttft_s)
        return await super()._complete(request)


class FakeServers:
    def __init__(self) -> None:
        self.events: list[str] = []
        self._server: FakeServer | None = None

    async def start(self, config: Configuration) -> str:
        self.events.append(f"start {config.name}")
        self._server = StallingOnBurst() if config.name == "shared" else FakeServer(STEADY)
        return await self._server.start()

    async def stop(self) -> None:
        assert self._server is not None
        await self._server.stop()
        self.events.append("stop")


def test_the_burst_windows_gaps_show_a_stall_the_quiet_ones_do_not() -> None:
    cfg = IsolationConfig(
        configs=parse_configs("shared=both:0;apart=both:1"),
        streams=2,
        stream_len=250,
        burst=1,
        long_len=8,
        settle_s=0.9,
        quiet_s=0.4,
        rounds=2,
    )
    servers = FakeServers()
    lines: list[str] = []
    results = asyncio.run(run_isolation(cfg, servers, vocab=500, say=lines.append))
    assert servers.events == ["start shared", "stop", "start apart", "stop"]
    shared, apart = results
    assert [r.configuration for r in results] == ["shared", "apart"]
    assert len(shared.rounds) == len(apart.rounds) == 2
    assert shared.median("burst_p99_ms") > 200 and shared.median("quiet_p99_ms") < 150
    assert shared.median_ratio() > 3
    assert apart.median("burst_p99_ms") < 150 and apart.median_ratio() < 3
    assert sum("round" in line for line in lines) == 4
