"""`splitserve bench isolation`: its flags (registered by loadtest/bench_cli.py), its run
and its report (a line per round, a table of medians, `isolation.json`).

The one subtle rule: as for `bench slo`, every configuration's cores are checked before any
server starts, and a bad flag exits with its reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from loadtest.slo.cli import add_server_flags
from loadtest.slo.config import parse_configs
from loadtest.slo.isolation import IsolationConfig, RowResult, run_isolation
from loadtest.slo.servers import LocalServers
from services.worker.pinning import check_cpus
from shared.errors import ConfigError


def add_parser(targets: argparse._SubParsersAction) -> None:
    iso = targets.add_parser(
        "isolation", help="running streams' inter-token gaps before and during a long-prompt burst"
    )
    add_server_flags(iso, "artifacts/bench-isolation")
    iso.add_argument("--streams", type=int, default=4, help="running before the burst")
    iso.add_argument("--stream-len", type=int, default=512, help="tokens each stream wants")
    iso.add_argument("--burst", type=int, default=2, help="long prompts sent together")
    iso.add_argument("--long-len", type=int, default=1024, help="tokens of each long prompt")
    iso.add_argument("--settle", type=float, default=2.0, help="seconds before the quiet window")
    iso.add_argument("--quiet", type=float, default=3.0, help="seconds of the quiet window")
    iso.add_argument("--rounds", type=int, default=3)
    iso.add_argument("--seed", type=int, default=0)
    iso.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> IsolationConfig:
    positive = {
        "--streams": args.streams,
        "--stream-len": args.stream_len,
        "--burst": args.burst,
        "--long-len": args.long_len,
        "--quiet": args.quiet,
        "--rounds": args.rounds,
    }
    if bad := [name for name, value in positive.items() if value <= 0]:
        raise ConfigError(f"{', '.join(bad)}: must be positive")
    return IsolationConfig(
        configs=parse_configs(args.configs),
        streams=args.streams,
        stream_len=args.stream_len,
        burst=args.burst,
        long_len=args.long_len,
        settle_s=args.settle,
        quiet_s=args.quiet,
        rounds=args.rounds,
        seed=args.seed,
    )


def table(results: list[RowResult]) -> str:
    lines = [
        "| configuration | ITL p50 quiet → burst (ms) | ITL p99 quiet → burst (ms) "
        "| burst/quiet p99 |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.configuration} | {r.median('quiet_p50_ms'):.1f} → {r.median('burst_p50_ms'):.1f}"
            f" | {r.median('quiet_p99_ms'):.1f} → {r.median('burst_p99_ms'):.1f}"
            f" | {r.median_ratio():.2f} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    from shared.models.pull import pull_model

    try:
        cfg = config_from_args(args)
        for row in cfg.configs:
            check_cpus(row.cpus)
    except ConfigError as exc:
        sys.exit(f"splitserve bench isolation: {exc}")
    model_dir = args.model_dir or pull_model(args.model, keep_quant=False)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    servers = LocalServers(model_dir, args.out / "logs", tuple(args.up_args), args.start_timeout)
    results = asyncio.run(run_isolation(cfg, servers, vocab))
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "isolation.json"
    path.write_text(json.dumps([r.as_json() for r in results], indent=1))
    print(f"wrote {path}")
