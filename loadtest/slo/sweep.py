"""The sweep of `splitserve bench slo`: each configuration in turn, started alone, then every
workload at every rate through the open-loop runner (loadtest/openloop.py), and what each
run attained (`Point`); then each (configuration, workload)'s goodput (`Goodput`).

Each configuration gets the same requests (the seed of a run is the run's workload and
rate, never its configuration); `Servers` starts one (`splitserve up --pool ...`, a peer,
or in tests a scripted fake) and stops it, whatever the sweep raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from loadtest.client import ClientConfig
from loadtest.datasets import LOW_TOKEN_ID
from loadtest.metrics import Stats
from loadtest.openloop import OpenLoopConfig, RunResult, run_open_loop
from loadtest.outputs import discover_model
from loadtest.request import BenchRequest
from loadtest.slo.attainment import Slo, attainment, goodput
from loadtest.slo.config import Configuration, SloBenchConfig
from loadtest.slo.workloads import WorkloadSpec, workload_requests
from services.worker.pinning import cpu_list

WARMUP_REQUESTS = 2  # short ones, before a configuration's first run: not measured


class Servers(Protocol):
    async def start(self, config: Configuration) -> str:
        """Start `config`'s server alone and return its base URL once it is ready."""
        ...

    async def stop(self) -> None:
        """Stop the server started last (nothing when none runs)."""
        ...


@contextlib.asynccontextmanager
async def serving(
    servers: Servers, row: Configuration, timeout_s: float
) -> AsyncIterator[ClientConfig]:
    """`row`'s server started and ready, as a client of its model whose requests time out
    after `timeout_s`; stopped on the way out, whatever happened."""
    try:
        url = await servers.start(row)
        model = await asyncio.to_thread(discover_model, url)
        yield ClientConfig(url, model, timeout_s=timeout_s)
    finally:
        await servers.stop()


@dataclass(frozen=True, slots=True)
class Point:
    """One run: a configuration, a workload, a rate, and what its requests attained."""

    configuration: str
    workload: str
    rate: float  # requests per second asked
    requests: int  # sent
    completed: int
    met: int  # completed within both objectives
    attainment: float  # met / requests
    ttft_p50_ms: float  # of the completed requests
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    duration_s: float  # first send to last reply
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by kind
    # Each request in send order: [label, send offset s, TTFT s, TPOT s], TTFT and TPOT None
    # when it failed (TPOT also for one token): another SLO can be judged from the JSON, and
    # the simulator compared with the same requests.
    latencies: list[list[object]] = field(default_factory=list)

    @classmethod
    def of(cls, config: str, workload: str, rate: float, run: RunResult, slo: Slo) -> Point:
        ok = [r for r in run.records if r.ok]
        ttft = Stats.of([r.ttft for r in ok])
        tpot = Stats.of([t for r in ok if (t := r.tpot) is not None])
        return cls(
            configuration=config,
            workload=workload,
            rate=rate,
            requests=len(run.records),
            completed=len(ok),
            met=sum(slo.met_by(r) for r in run.records),
            attainment=attainment(run.records, slo),
            ttft_p50_ms=ttft.median,
            ttft_p99_ms=ttft.p99,
            tpot_p50_ms=tpot.median,
            tpot_p99_ms=tpot.p99,
            duration_s=run.duration,
            errors=dict(Counter(r.error for r in run.records if not r.ok)),
            latencies=_latencies(run),
        )

    def line(self) -> str:
        failed = f", {self.requests - self.completed} failed" if self.errors else ""
        return (
            f"{self.configuration} {self.workload} @ {self.rate:g}/s: attainment "
            f"{self.attainment:.0%} ({self.met}/{self.requests}{failed}); TTFT p50 "
            f"{self.ttft_p50_ms:.0f} ms, p99 {self.ttft_p99_ms:.0f}; TPOT p50 "
            f"{self.tpot_p50_ms:.1f} ms, p99 {self.tpot_p99_ms:.1f}"
        )


def _latencies(run: RunResult) -> list[list[object]]:
    start = min((r.send for r in run.records), default=0.0)
    return [
        [r.label, round(r.send - start, 4), r.ttft if r.ok else None, r.tpot if r.ok else None]
        for r in sorted(run.records, key=lambda r: r.send)
    ]


@dataclass(frozen=True, slots=True)
class Goodput:
    configuration: str
    workload: str
    cost: int  # cores
    goodput: float  # requests per second: the highest rate attaining the target
    per_core: float  # goodput / cost


def goodputs(points: list[Point], rows: tuple[Configuration, ...], target: float) -> list[Goodput]:
    """Each (configuration, workload)'s goodput from its points, in the points' order."""
    cost = {row.name: row.cost for row in rows}
    pairs = dict.fromkeys((p.configuration, p.workload) for p in points)
    found = []
    for name, workload in pairs:
        curve = [
            (p.rate, p.attainment)
            for p in points
            if (p.configuration, p.workload) == (name, workload)
        ]
        rate = goodput(curve, target)
        found.append(Goodput(name, workload, cost[name], rate, rate / cost[name]))
    return found


def run_seed(seed: int, workload: str, rate_index: int) -> int:
    """The seed of one run: its workload's and rate's, the same for every configuration."""
    return random.Random(f"{seed}/{workload}/{rate_index}").getrandbits(31)


async def run_sweep(
    cfg: SloBenchConfig, servers: Servers, vocab_size: int, say: Callable[[str], None] = print
) -> list[Point]:
    """Every row of `cfg` (configurations, then peers) × workload × rate, in that order."""
    spec = WorkloadSpec(
        cfg.num_prompts,
        vocab_size,
        cfg.phase_seconds,
        cfg.phases,
        cfg.out / "traces",
        cfg.long_len,
        cfg.shift_mix,
    )
    points: list[Point] = []
    for row in cfg.rows:
        say(f"{row.name}: starting {row.server} on cores {cpu_list(row.cpus)}")
        async with serving(servers, row, cfg.request_timeout_s) as client:
            await run_open_loop(client, OpenLoopConfig(show_progress=False), _warmup(vocab_size))
            for workload in cfg.workloads:
                for i, rate in enumerate(cfg.rates):
                    seed = run_seed(cfg.seed, workload, i)
                    requests = workload_requests(workload, spec, rate, seed)
                    loop = OpenLoopConfig(request_rate=rate, seed=seed, show_progress=False)
                    run = await run_open_loop(client, loop, requests, f"{row.name}-{workload}")
                    points.append(Point.of(row.name, workload, rate, run, cfg.slo))
                    say(points[-1].line())
    return points


def _warmup(vocab_size: int) -> list[BenchRequest]:
    rng = random.Random("warm-up")
    return [
        BenchRequest(
            [rng.randrange(LOW_TOKEN_ID, vocab_size) for _ in range(16)], 16, 4, label="warm-up"
        )
        for _ in range(WARMUP_REQUESTS)
    ]
