"""`splitserve bench lora`'s flags; the benchmark itself (lora.py, which needs torch) is
imported only when it runs.

The one subtle rule: building the command line imports no torch (tests/unit/
test_config_flags.py checks every service's parser for it).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(targets: argparse._SubParsersAction) -> None:
    lora = targets.add_parser("lora", help="LoRA adapters: tok/s over many adapters vs the base")
    lora.add_argument("--model", default="", help="a known model (pulled; default: the default)")
    lora.add_argument("--model-dir", type=Path, help="an HF-layout directory instead")
    lora.add_argument("--concurrency", type=int, default=16)
    lora.add_argument("--adapters", type=int, default=8)
    lora.add_argument("--rank", type=int, default=16)
    lora.add_argument("--max-loras", type=int, default=8, help="slots (adapters per step)")
    lora.add_argument("--input-len", type=int, default=64)
    lora.add_argument("--output-len", type=int, default=64)
    lora.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    lora.add_argument(
        "--rounds", type=int, default=3, help="rounds of plain, LoRA base, adapters (medians)"
    )
    lora.add_argument(
        "--vllm", action="store_true", help="also vLLM-CPU with the same adapters (a peer row)"
    )
    lora.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.lora import LoraBenchConfig, run_lora_bench
    from shared.models.pull import pull_model
    from shared.models.registry import DEFAULT_MODEL

    model_dir = args.model_dir or pull_model(args.model or DEFAULT_MODEL, keep_quant=False)
    run_lora_bench(
        LoraBenchConfig(
            model_dir, args.concurrency, args.adapters, args.rank, args.input_len,
            args.output_len, args.max_loras, args.threads, args.vllm, args.rounds,
        )
    )  # fmt: skip
