"""`splitserve worker`: flags → WorkerConfig → run the worker until SIGTERM/SIGINT.

Also runnable alone: `python -m services.worker.cli --role decode --model-dir DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
from pathlib import Path

from services.worker.config import WorkerConfig
from shared.config import CommonConfig, add_common_args, add_metrics_port_arg, env
from shared.protocol import ROLES


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("worker", help="run a prefill, decode or combined worker")
    add_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=ROLES, default=env("role", "both"))
    parser.add_argument("--model-dir", type=Path, required=True, help="HF-layout model dir")
    parser.add_argument("--worker-id", default="", help="default: role + a short random id")
    parser.add_argument("--model-name", default="", help="reported in heartbeats; default: dir")
    parser.add_argument("--num-threads", type=int, default=env("num_threads", 1, int))
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="overrides the GiB")
    add_engine_arguments(parser)
    add_common_args(parser)
    add_metrics_port_arg(parser)


def add_engine_arguments(parser: argparse._ActionsContainer) -> None:
    """The engine's flags: the worker's own, and forwarded to every worker by `up`."""
    parser.add_argument("--kv-cache-gib", type=float, default=env("kv_cache_gib", 2.0, float))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights and KV cache (on a GPU, bfloat16)",
    )
    parser.add_argument(
        "--attention-backend", choices=("auto", "torch", "cpu", "triton"), default="auto"
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch-invariant matmuls, so seeded tokens survive migration "
        "(default: on when the C++ kernels are built and the weights are float)",
    )
    parser.add_argument("--quantization", choices=("int8", "int4"), help="weight-only, at load")
    parser.add_argument(
        "--speculative", choices=("ngram", "draft"), help="speculative decoding method"
    )
    parser.add_argument("--draft-model", type=Path, help="--speculative draft: HF-layout dir")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens/step")


def engine_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags in `args` that differ from their defaults, as worker arguments."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(defaults)
    argv: list[str] = []
    for action in defaults._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])
        else:
            value = value.resolve() if isinstance(value, Path) else value
            argv += [action.option_strings[0], str(value)]
    return tuple(argv)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    common = CommonConfig.from_args(args)
    return WorkerConfig(
        worker_id=args.worker_id or f"{args.role}-{secrets.token_hex(3)}",
        role=args.role,
        model_dir=args.model_dir,
        model_name=args.model_name or args.model_dir.resolve().name,
        nats_url=common.nats_url,
        namespace=common.namespace,
        num_threads=args.num_threads,
        kv_cache_gib=args.kv_cache_gib,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        batch_invariant=args.batch_invariant,
        quantization=args.quantization,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model_dir=args.draft_model,
        otlp_endpoint=common.otlp_endpoint,
        metrics_port=args.metrics_port,
    )


async def serve(config: WorkerConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down in order."""
    from services.worker.runtime import Worker  # torch loads here, not at flag parsing

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(config)
    try:
        await worker.start()
        await stop.wait()
    finally:
        await worker.shutdown()


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_from_args(args)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="splitserve worker")
    add_arguments(parser)
    main(parser.parse_args())
