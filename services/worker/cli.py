"""`splitserve worker`: flags → WorkerConfig → run the worker until SIGTERM/SIGINT.

Also runnable alone: `python -m services.worker.cli --role decode --model-dir DIR`.
Flags come from the dataclasses (`shared/flags.py`): the worker's own from WorkerConfig,
the engine's from EngineConfig; `up` forwards the engine's with `engine_argv`. A worker given
`--cpus` is pinned to them here, before its engine or any of its threads starts. A
configuration it cannot run (a bad flag, or one its engine refuses at start) ends it with
services/cannot_run.py's status, which `up` does not restart.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from collections.abc import Sequence

from services.cannot_run import exit_cannot_run
from services.worker.config import WorkerConfig
from services.worker.pinning import pin
from shared.config import CommonConfig, add_common_args, add_metrics_port_arg
from shared.engine.engine_config import EngineConfig
from shared.errors import ConfigError
from shared.flags import add_flags, build, changed_argv
from shared.service_loop import log_to_stderr, run, run_until_signal

NOT_ENGINE_FLAGS = ("model_id",)  # derived: the worker's model name


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("worker", help="run a prefill, decode or combined worker")
    add_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, WorkerConfig)
    add_engine_arguments(parser)
    add_common_args(parser)
    add_metrics_port_arg(parser)


def add_engine_arguments(parser: argparse._ActionsContainer, skip: Sequence[str] = ()) -> None:
    """The engine's flags: the worker's own, and forwarded to every worker by `up`."""
    add_flags(parser, EngineConfig, (*NOT_ENGINE_FLAGS, *skip))


def engine_argv(args: argparse.Namespace, skip: Sequence[str] = ("model_dir",)) -> tuple[str, ...]:
    """The engine flags in `args` that differ from their defaults, as worker arguments."""
    return changed_argv(EngineConfig, args, (*NOT_ENGINE_FLAGS, *skip))


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    model_name = args.model_name or args.model_dir.resolve().name
    return build(
        WorkerConfig,
        args,
        worker_id=args.worker_id or f"{args.role}-{secrets.token_hex(3)}",
        model_name=model_name,
        engine=build(EngineConfig, args),
        common=CommonConfig.from_args(args),
        metrics_port=args.metrics_port,
    )


async def serve(config: WorkerConfig) -> bool:
    """Run until SIGTERM or SIGINT, then shut down in order; True when the worker failed."""
    from services.worker.runtime import Worker  # torch loads here, not at flag parsing

    worker = Worker(config)
    return await run_until_signal(worker.start, worker.shutdown, worker.failed)


def main(args: argparse.Namespace) -> None:
    log_to_stderr(args.log_level)
    try:
        config = config_from_args(args)
        pin(config.pinned_cpus)  # a core this machine lacks: refused like a bad flag
    except ConfigError as exc:
        exit_cannot_run("worker", str(exc))
    try:
        failed = run(serve(config))
    except ConfigError as exc:
        exit_cannot_run("worker", str(exc))
    from services.worker.engine_thread import still_loading  # imported by serve already

    if still_loading():  # stopped while the weights loaded: torch must not be torn down
        logging.shutdown()  # under that thread (a C++ terminate), so skip the finalizers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if failed else 0)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="splitserve worker")
    add_arguments(parser)
    main(parser.parse_args())
