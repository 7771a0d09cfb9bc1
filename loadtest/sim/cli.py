"""`splitserve bench sim`: its flags (registered by loadtest/bench_cli.py) and its runs:
a sweep like `bench slo`'s over simulated configurations, `--search N` (the best split of N
workers), `--compare SLO_JSON` (a measured run beside its simulation), and `calibrate`
(rebuild the `cpu-here` cost model from the engine on this machine: calibrate.py).

The one subtle rule: every output starts with the cost model's name and source, so a
figure from `gpu-h100-published` always says "published figures, not measured".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from loadtest.sim import cost_model
from loadtest.sim.config import DEFAULT_VOCAB, SimBenchConfig, parse_workers, splits
from loadtest.sim.mesh import MeshSettings
from loadtest.sim.planner_hook import Decider
from loadtest.sim.worker import MODEL, EngineLimits
from loadtest.slo.attainment import Slo
from loadtest.slo.cli import add_sweep_flags, sweep_settings
from loadtest.slo.config import SloBenchConfig
from services.planner.config import PlannerConfig
from services.scheduler.config import PATH_CHOICES, SchedulerConfig
from shared.engine.engine_config import NATIVE_BLOCK_SIZE
from shared.errors import ConfigError
from shared.flags import add_flags, build

DEFAULT_WORKERS = "split=prefill:1,decode:1;aggregated=both:1x2;two=both:2"


def add_parser(targets: argparse._SubParsersAction) -> None:
    sim = targets.add_parser("sim", help="simulated goodput at SLO, 1 to 64+ workers (no model)")
    sim.add_argument(
        "action", nargs="?", choices=("calibrate",), help="rebuild --cost-model (cpu-here)"
    )
    sim.add_argument("--workers", default=DEFAULT_WORKERS, help="NAME=ROLE:COUNT[xCORES],...;...")
    add_sweep_flags(sim, "long")
    sim.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="workload token ids")
    sim.add_argument("--cost-model", default="cpu-here", help=f"{cost_model.NAMES} or a JSON")
    sim.add_argument("--path-choice", choices=PATH_CHOICES, default="fixed", help="scheduler's")
    sim.add_argument("--local-prefill-tokens", type=int, default=16, help="scheduler's")
    sim.add_argument("--stall-weight", type=float, default=0.1, help="scheduler's")
    sim.add_argument("--path-slo", help="scheduler's (--path-choice slo); default: --slo's")
    sim.add_argument("--max-num-batched-tokens", type=int, help="default: the cost model's")
    sim.add_argument("--planner", action="store_true", help="services.planner.policy.Planner")
    sim.add_argument("--planner-mode", choices=("roles", "replicas"), default="roles")
    sim.add_argument("--planner-interval", type=float, default=10.0, help="seconds, simulated")
    sim.add_argument(
        "--planner-window", type=float, default=60.0, help="seconds of samples a decision sees"
    )
    add_flags(sim, PlannerConfig)  # the policy's own flags, as `splitserve planner` takes them
    sim.add_argument("--search", type=int, metavar="N", help="every split of N workers")
    sim.add_argument("--search-step", type=int, help="counts in steps of (default N/8, >= 1)")
    sim.add_argument("--cores-per-worker", type=int, default=1, help="--search's workers")
    sim.add_argument("--compare", type=Path, metavar="SLO_JSON", help="a bench slo result")
    sim.add_argument("--out", type=Path, default=Path("artifacts/bench-sim"))
    sim.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> SimBenchConfig:
    cost = cost_model.load(args.cost_model)
    if args.search:
        step = args.search_step or max(1, args.search // 8)
        configs = splits(args.search, step, args.cores_per_worker)
    else:
        configs = parse_workers(args.workers)
    bench = SloBenchConfig(configs=configs, **sweep_settings(args), out=args.out)
    scheduler = SchedulerConfig(
        path_choice=args.path_choice,
        local_prefill_tokens=args.local_prefill_tokens,
        stall_weight=args.stall_weight,
        path_slo=args.path_slo or f"ttft={bench.slo.ttft_s},tpot={bench.slo.tpot_s}",
        model_id=MODEL,
        block_size=NATIVE_BLOCK_SIZE,  # the simulated workers' (native engines)
    )
    budget = args.max_num_batched_tokens or cost.token_budget
    limits = EngineLimits(scheduler.block_size, budget, cost.max_num_seqs)
    planner = real_planner(args, bench.slo) if args.planner else None
    return SimBenchConfig(
        bench,
        cost,
        MeshSettings(scheduler, limits, new_worker_cores=args.cores_per_worker),
        vocab_size=args.vocab_size,
        planner=planner,
        planner_interval_s=args.planner_interval,
        planner_window_s=args.planner_window,
    )


def real_planner(args: argparse.Namespace, slo: Slo) -> Callable[[], Decider]:
    """A fresh services.planner.policy.Planner per run, with the bench's objectives."""
    from services.planner.policy import Planner

    mode, ttft, tpot = args.planner_mode, slo.ttft_s, slo.tpot_s
    config = build(PlannerConfig, args, mode=mode, ttft_slo=ttft, tpot_slo=tpot)
    return lambda: Planner(config)


def main(args: argparse.Namespace) -> None:
    from loadtest.sim import report

    try:
        if args.action == "calibrate":
            from loadtest.sim.calibrate import calibrate

            calibrate(cost_model.path_of(args.cost_model))
            return
        cfg = config_from_args(args)
        if args.compare:
            from loadtest.sim.compare import read_measured

            measured = read_measured(args.compare, args.long_len)
            report.run_compare(replace(cfg, bench=replace(measured.bench, out=args.out)), measured)
        elif args.search:
            report.run_search(cfg)
        else:
            report.run_sweep(cfg)
    except ConfigError as exc:
        sys.exit(f"splitserve bench sim: {exc}")
