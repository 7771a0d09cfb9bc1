"""Command line of the harness: `python -m loadtest serve|users|plot|matrix`, also as
`splitserve bench serve|users|plot|matrix`. Flags follow `vllm bench serve` and Locust."""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

# Light imports only: `splitserve` builds this parser for every command; aiohttp and
# matplotlib load when a run starts.
from loadtest.datasets import LOADERS, DatasetConfig, load_dataset
from shared.models.registry import DEFAULT_MODEL

if TYPE_CHECKING:
    from loadtest.client import ClientConfig

SCENARIO_NAMES = ("chat", "rag", "long-prompt", "mixed")


def parse_duration(text: str) -> float:
    """`90`, `90s`, `2m`, `1h` → seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def _add_common(p: argparse.ArgumentParser, endpoint: str) -> None:
    p.add_argument("--host", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default=endpoint)
    p.add_argument("--api-key", default="")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--slo", default="", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("artifacts/loadtest"),
        help="directory for the JSON result and the PNG report",
    )
    p.add_argument("--label", default="", help="names the run in the table and the files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _client(args: argparse.Namespace) -> ClientConfig:
    from loadtest.client import ClientConfig
    from loadtest.outputs import discover_model

    model = args.model or discover_model(args.host, args.api_key)
    return ClientConfig(
        args.host, model, args.endpoint, not args.no_ignore_eos, args.api_key, args.timeout
    )


def _serve(args: argparse.Namespace) -> None:
    from loadtest.metrics import parse_slo
    from loadtest.openloop import OpenLoopConfig, run_open_loop
    from loadtest.outputs import finish_run

    dataset = DatasetConfig(
        name=args.dataset_name,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=args.vocab_size,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        num_turns=args.num_turns,
        path=args.dataset_path,
        block_size=args.block_size,
        seed=args.seed,
    )
    loop = OpenLoopConfig(
        args.request_rate, args.burstiness, args.max_concurrency, args.seed, not args.no_progress
    )
    client = _client(args)
    label = args.label or f"{dataset.name}-c{args.max_concurrency or 'inf'}"
    run = asyncio.run(run_open_loop(client, loop, load_dataset(dataset), label))
    config = {
        "mode": "open-loop",
        "client": asdict(client),
        "dataset": asdict(dataset),
        "arrivals": asdict(loop),
    }
    finish_run(label, config, run, parse_slo(args.slo), args.out)


def _users(args: argparse.Namespace) -> None:
    from loadtest.metrics import parse_slo
    from loadtest.outputs import finish_run
    from loadtest.scenarios import load_scenario
    from loadtest.users import UsersConfig, run_users

    cfg = UsersConfig(
        args.users, args.spawn_rate, parse_duration(args.run_time), args.seed, not args.no_progress
    )
    client = _client(args)
    label = args.label or f"{Path(args.scenario).stem}-u{args.users}"
    run = asyncio.run(run_users(client, cfg, load_scenario(args.scenario), label))
    config = {
        "mode": "closed-loop",
        "client": asdict(client),
        "scenario": args.scenario,
        "users": asdict(cfg),
    }
    finish_run(label, config, run, parse_slo(args.slo), args.out)


def _matrix(args: argparse.Namespace) -> None:
    from loadtest.matrix import MatrixConfig, run_matrix

    run_matrix(
        MatrixConfig(
            model=args.model,
            model_dir=args.model_dir,
            out=args.out,
            num_prompts=args.num_prompts,
            concurrencies=tuple(int(c) for c in args.concurrency.split(",")),
        )
    )


def _plot(args: argparse.Namespace) -> None:
    import json

    from loadtest.metrics import summarize
    from loadtest.plot import write_png
    from loadtest.report import run_from_json

    payload = json.loads(args.result.read_text())
    run = run_from_json(payload)
    summary = summarize(run.records, run.duration, payload["config"].get("slo") or None)
    png = args.png or args.result.with_suffix(".png")
    write_png(png, args.title or args.result.stem, run, summary)
    print(png)


def add_subcommands(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="open-loop load like `vllm bench serve`")
    _add_common(serve, "completions")
    serve.add_argument("--dataset-name", choices=sorted(LOADERS), default="random")
    serve.add_argument("--dataset-path", type=Path, help="ShareGPT JSON or Mooncake JSONL")
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="random: prompt tokens; shared-prefix: suffix tokens",
    )
    serve.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="max_tokens (sharegpt: 0 = the reference reply's length)",
    )
    serve.add_argument("--vocab-size", type=int, default=32000, help="random token id range")
    serve.add_argument(
        "--prefix-len", type=int, default=512, help="shared-prefix, multi-turn: shared tokens"
    )
    serve.add_argument("--num-prefixes", type=int, default=4)
    serve.add_argument(
        "--num-turns", type=int, default=8, help="multi-turn: turns per conversation"
    )
    serve.add_argument("--block-size", type=int, default=512, help="mooncake tokens per hash id")
    serve.add_argument("--request-rate", type=float, default=math.inf)
    serve.add_argument("--burstiness", type=float, default=1.0)
    serve.add_argument("--max-concurrency", type=int)
    serve.set_defaults(func=_serve)

    users = commands.add_parser("users", help="closed-loop Locust-style users")
    _add_common(users, "chat")
    users.add_argument(
        "--scenario",
        default="chat",
        help=f"{', '.join(SCENARIO_NAMES)}, or a .py file defining SCENARIO",
    )
    users.add_argument("--users", type=int, default=10)
    users.add_argument("--spawn-rate", type=float, default=1.0)
    users.add_argument("--run-time", default="60s")
    users.set_defaults(func=_users)

    plot = commands.add_parser("plot", help="draw the PNG report of a JSON result again")
    plot.add_argument("result", type=Path)
    plot.add_argument("--png", type=Path, help="default: the result's name with .png")
    plot.add_argument("--title", default="")
    plot.set_defaults(func=_plot)

    matrix = commands.add_parser("matrix", help="start the mesh and run the standard matrix")
    matrix.add_argument("--model", default=DEFAULT_MODEL)
    matrix.add_argument("--model-dir", type=Path)
    matrix.add_argument("--num-prompts", type=int, default=32)
    matrix.add_argument("--concurrency", default="1,4,8,16")
    matrix.add_argument("--out", type=Path, default=Path("artifacts/loadtest"))
    matrix.set_defaults(func=_matrix)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)
