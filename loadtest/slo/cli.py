"""`splitserve bench slo`: its flags (registered by loadtest/bench_cli.py) and its run.

The one subtle rule: the flags are checked whole (`SloBenchConfig`), and every
configuration's cores against this machine's, before the peers' venv is set up or any
server starts; a bad flag exits with its reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from loadtest.slo.attainment import Slo
from loadtest.slo.config import PEERS, WORKLOADS, SloBenchConfig, parse_configs, parse_rates
from services.worker.pinning import check_cpus
from shared.errors import ConfigError
from shared.models.registry import DEFAULT_MODEL

DEFAULT_CONFIGS = "split=prefill:0,decode:1;aggregated=both:0-1"


def add_server_flags(parser: argparse.ArgumentParser, out: str) -> None:
    """The flags of the benches that start configurations of pinned pools in turn."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a known model (pulled)")
    parser.add_argument("--model-dir", type=Path, help="an HF-layout directory instead")
    parser.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help="NAME=ROLE:CPUS,...; separated by ';'"
    )
    parser.add_argument("--start-timeout", type=float, default=600.0, help="per server, seconds")
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("up_args", nargs="*", help="more flags for every `splitserve up`, after --")


def add_sweep_flags(parser: argparse.ArgumentParser, workloads: str) -> None:
    """The flags of a rate sweep at SLO: `bench slo`'s, and `bench sim`'s too."""
    parser.add_argument("--workloads", default=workloads, help=f"of {','.join(WORKLOADS)}")
    parser.add_argument("--rates", default="0.25,0.5,1,2", help="requests/s, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=40, help="per rate (not shift's)")
    parser.add_argument("--slo", default="ttft=1s,tpot=40ms", help="both, each with s or ms")
    parser.add_argument("--attainment", type=float, default=0.9, help="target share of requests")
    parser.add_argument("--phase-seconds", type=float, default=120.0, help="shift: each phase")
    parser.add_argument("--phases", type=int, default=2, help="shift: chat, long, chat, ...")
    parser.add_argument(
        "--shift-mix", default="chat,long", help="shift: the phases' kinds in turn (chat,long,gen)"
    )
    parser.add_argument(
        "--long-len", type=int, default=2048, help="prompt tokens of long (mixed, shift) prompts"
    )
    parser.add_argument("--seed", type=int, default=0)


def sweep_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`add_sweep_flags`' values as SloBenchConfig's fields (checked when it is made)."""
    return {
        "slo": Slo.parse(args.slo),
        "workloads": tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        "rates": parse_rates(args.rates),
        "num_prompts": args.num_prompts,
        "attainment": args.attainment,
        "phase_seconds": args.phase_seconds,
        "phases": args.phases,
        "long_len": args.long_len,
        "shift_mix": tuple(k.strip() for k in args.shift_mix.split(",") if k.strip()),
        "seed": args.seed,
    }


def add_parser(targets: argparse._SubParsersAction) -> None:
    slo = targets.add_parser(
        "slo", help="goodput at SLO: pinned configurations of equal cores, a rate sweep"
    )
    add_server_flags(slo, "artifacts/bench-slo")
    add_sweep_flags(slo, ",".join(WORKLOADS))
    slo.add_argument("--peer", choices=PEERS, help="also run it on each configuration's cores")
    slo.add_argument("--peers-venv", type=Path, default=Path(".venv-peers"))
    slo.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    slo.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    slo.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> SloBenchConfig:
    return SloBenchConfig(
        configs=parse_configs(args.configs),
        **sweep_settings(args),
        peer=args.peer or "",
        model=args.model,
        model_dir=args.model_dir,
        up_args=tuple(args.up_args),
        peers_venv=args.peers_venv,
        vllm_kv_cache_gib=args.vllm_kv_cache_gib,
        start_timeout_s=args.start_timeout,
        request_timeout_s=args.timeout,
        out=args.out,
    )


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> None:
    from loadtest.peers.peer_venv import PeerSetupError, PeerVenv, ensure_vllm

    try:
        cfg = config_from_args(args)
        for row in cfg.configs:
            check_cpus(row.cpus)
        vllm_python = ensure_vllm(PeerVenv(cfg.peers_venv)) if cfg.peer else None
    except (ConfigError, PeerSetupError) as exc:
        sys.exit(f"splitserve bench slo: {exc}")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwinds: the running server is stopped
    run(cfg, vllm_python)


def run(cfg: SloBenchConfig, vllm_python: Path | None) -> None:
    from loadtest.slo.report import format_tables, write_results
    from loadtest.slo.servers import LocalServers
    from loadtest.slo.sweep import goodputs, run_sweep
    from shared.models.pull import pull_model

    model_dir = cfg.model_dir or pull_model(cfg.model, keep_quant=False)
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    costs = sorted({row.cost for row in cfg.configs})
    if len(costs) > 1:
        print(f"note: the configurations hold {costs} cores: compare their goodput per core")
    servers = LocalServers(
        model_dir,
        cfg.out / "logs",
        cfg.up_args,
        cfg.start_timeout_s,
        vllm_python,
        cfg.vllm_kv_cache_gib,
    )
    points = asyncio.run(run_sweep(cfg, servers, vocab_size))
    found = goodputs(points, cfg.rows, cfg.attainment)
    print(format_tables(cfg, points, found))
    json_path, png_path = write_results(cfg, points, found)
    print(f"wrote {json_path} and {png_path}")
