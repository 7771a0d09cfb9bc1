"""One simulated run (`simulate`), `bench slo`'s sweep over simulated configurations
(`sweep`), and the search for the best split of N workers (`search`).

Each run gets the requests and send times `bench slo` would send (its workloads, its seeds:
loadtest/slo/sweep.py:run_seed, loadtest/arrivals.py), and answers a `RunResult` of the
records the load harness would have made, so `Point`, `goodputs` and the report of
loadtest/slo apply unchanged.

The one subtle rule: a run is a function of (configuration, workload, rate, seed) alone: a
fresh event loop seeded from the run's seed, a fresh mesh, a fresh decider.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.arrivals import send_offsets
from loadtest.openloop import RunResult
from loadtest.request import BenchRequest
from loadtest.sim.config import SimBenchConfig, worker_specs
from loadtest.sim.events import EventLoop
from loadtest.sim.mesh import SimMesh, WorkerSpec
from loadtest.sim.planner_hook import plan_forever
from loadtest.sim.requests import SimRequest
from loadtest.sim.worker import MODEL
from loadtest.slo.config import Configuration
from loadtest.slo.sweep import Goodput, Point, goodputs, run_seed
from loadtest.slo.workloads import WorkloadSpec, workload_requests
from shared.engine.block_hash import hash_full_blocks


@dataclass(frozen=True, slots=True)
class Simulated:
    run: RunResult
    mesh: SimMesh


def simulate(
    cfg: SimBenchConfig,
    specs: list[WorkerSpec],
    requests: list[BenchRequest],
    offsets: list[float],
    seed: int,
) -> Simulated:
    """`requests` sent at `offsets` (seconds) to a mesh of `specs`, to the end of each."""
    loop = EventLoop(seed)
    mesh = SimMesh(loop, cfg.cost, specs, cfg.settings)
    if cfg.planner is not None:
        plan_forever(mesh, cfg.planner(), cfg.planner_interval_s, cfg.planner_window_s)
    block_size = cfg.settings.scheduler.block_size
    for i, (request, offset) in enumerate(zip(requests, offsets, strict=True)):
        if not isinstance(request.prompt, list):
            raise TypeError("the simulator takes prompts as token ids")
        hashes = hash_full_blocks(request.prompt, block_size, MODEL)
        sim = SimRequest(f"r{i}", request.label, request.prompt, hashes, request.output_len, offset)
        loop.at(offset, lambda r=sim: mesh.submit(r))
    horizon = max(offsets, default=0.0) + cfg.settings.request_timeout_s
    loop.run(horizon, done=lambda: len(mesh.requests) == len(requests) and not mesh.open)
    for request in mesh.requests:
        if not request.done:
            request.error = "timeout"
    records = [r.record() for r in mesh.requests]
    duration = max((r.end for r in records), default=0.0)
    return Simulated(RunResult(records, 0.0, duration), mesh)


@dataclass(frozen=True, slots=True)
class Ran:
    point: Point
    decisions: list[list[object]]  # the planner's: [time s, action, reason, role, worker, detail]


def run_point(
    cfg: SimBenchConfig, row: Configuration, workload: str, rate_index: int, trace_dir: Path
) -> Ran:
    bench = cfg.bench
    rate = bench.rates[rate_index]
    spec = WorkloadSpec(
        bench.num_prompts,
        cfg.vocab_size,
        bench.phase_seconds,
        bench.phases,
        trace_dir,
        bench.long_len,
        bench.shift_mix,
    )
    seed = run_seed(bench.seed, workload, rate_index)
    requests = workload_requests(workload, spec, rate, seed)
    offsets = send_offsets(requests, rate, 1.0, seed)
    sim = simulate(cfg, worker_specs(row), requests, offsets, seed)
    decisions = [
        [round(when, 3), d.action.name, d.reason.name, d.role, d.worker_id, d.detail]
        for when, d in sim.mesh.decisions
    ]
    return Ran(Point.of(row.name, workload, rate, sim.run, bench.slo), decisions)


def sweep(cfg: SimBenchConfig, say: Callable[[str], None] = print) -> list[Ran]:
    """Every configuration × workload × rate, as `bench slo` orders them."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="splitserve-sim-") as trace_dir:
        for row in cfg.bench.configs:
            for workload in cfg.bench.workloads:
                for i in range(len(cfg.bench.rates)):
                    runs.append(run_point(cfg, row, workload, i, Path(trace_dir)))
                    decided = f"; {len(runs[-1].decisions)} decisions" if cfg.planner else ""
                    say(runs[-1].point.line() + decided)
    return runs


def search(cfg: SimBenchConfig, say: Callable[[str], None] = print) -> list[Goodput]:
    """Each configuration's goodput per workload, rates tried upwards until one misses the
    target (goodput needs no higher rate then), best first."""
    bench = cfg.bench
    found: list[Goodput] = []
    with tempfile.TemporaryDirectory(prefix="splitserve-sim-") as trace_dir:
        for row in bench.configs:
            for workload in bench.workloads:
                points = []
                for i in range(len(bench.rates)):
                    points.append(run_point(cfg, row, workload, i, Path(trace_dir)).point)
                    if points[-1].attainment < bench.attainment:
                        break
                found += goodputs(points, bench.configs, bench.attainment)
                say(f"{row.name} {workload}: goodput {found[-1].goodput:g} req/s")
    return sorted(found, key=lambda g: (g.workload, -g.goodput, g.configuration))


def with_configs(cfg: SimBenchConfig, configs: tuple[Configuration, ...]) -> SimBenchConfig:
    return replace(cfg, bench=replace(cfg.bench, configs=configs))
