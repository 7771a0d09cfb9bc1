"""`splitserve bench engine`: our engine against `transformers.generate` on the same machine.

(a) offline throughput: N requests of random prompt tokens, fixed output length (ignore_eos);
    ours with continuous batching, transformers with static batches.
(b) single-stream decode: one request, output tokens per second after the first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine import batch_invariant
from shared.engine.attention import resolve_backend
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class BenchConfig:
    model: str
    model_dir: Path | None
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 128
    hf_batch_size: int = 32
    with_transformers: bool = True
    profile: bool = False
    attention_backend: str = "auto"
    batch_invariant: bool | None = None  # None: auto (EngineConfig's default)


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token ids, clear of the low ids where tokenizers keep their special tokens."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (num, length), generator=gen).tolist()


def engine_offline(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second for all prompts at once, prefill included."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"offline-{i}", prompt, params)
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    return produced / (time.perf_counter() - start)


def engine_single_stream(engine: LLMEngine, prompt: list[int], output_len: int) -> float:
    """Decode tokens per second of one request, timed from its first token on."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("single", prompt, params)
    engine.step()  # prefill and the first token
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    return produced / (time.perf_counter() - start)


def hf_generate(model, prompts: list[list[int]], output_len: int, batch_size: int) -> float:
    """Output tokens per second of transformers' static-batch greedy generate."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i : i + batch_size])
        model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
    return len(prompts) * output_len / (time.perf_counter() - start)


def hf_single_stream(model, prompt: list[int], output_len: int) -> float:
    """Decode tokens per second of batch-1 generate: total time minus a 1-token run."""
    ids = torch.tensor([prompt])
    kwargs = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    return (output_len - 1) / (time.perf_counter() - start - first)


def profile_decode(engine: LLMEngine, prompt: list[int], steps: int = 16) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request("profiled", prompt, params)
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def run_engine_bench(cfg: BenchConfig) -> None:
    model_dir = cfg.model_dir
    if model_dir is None:
        from shared.models.pull import pull_model

        model_dir = pull_model(cfg.model, keep_quant=False)
    config = EngineConfig(
        model_dir=model_dir,
        device="cpu",  # against transformers on the same CPU (GPUs: `splitserve bench gpu`)
        attention_backend=cfg.attention_backend,
        batch_invariant=cfg.batch_invariant,
    )
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(cfg.num_requests, cfg.input_len, vocab)
    backend = resolve_backend(cfg.attention_backend, config.torch_device)
    invariant = "on" if batch_invariant.resolve(config) else "off"
    print(
        f"model {model_dir} {engine.config.dtype}, torch threads {torch.get_num_threads()}, "
        f"attention {backend}, batch-invariant matmuls {invariant}"
    )
    print(f"workload: {cfg.num_requests} requests x {cfg.input_len} prompt -> {cfg.output_len}")
    engine_single_stream(engine, prompts[0][:16], 8)  # warm-up
    ours_single = engine_single_stream(engine, prompts[0], cfg.output_len)
    ours_offline = engine_offline(engine, prompts, cfg.output_len)
    rows = [("splitserve engine", ours_offline, ours_single)]
    if cfg.with_transformers:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            hf_single = hf_single_stream(model, prompts[0], cfg.output_len)
            hf_offline = hf_generate(model, prompts, cfg.output_len, cfg.hf_batch_size)
        rows.append((f"transformers (batch {cfg.hf_batch_size} / 1)", hf_offline, hf_single))
    print(f"{'':34} {'offline out tok/s':>18} {'single-stream tok/s':>20}")
    for name, offline, single in rows:
        print(f"{name:34} {offline:18.1f} {single:20.1f}")
    if cfg.with_transformers:
        print(
            f"{'ratio (ours / transformers)':34} {rows[0][1] / rows[1][1]:17.2f}x "
            f"{rows[0][2] / rows[1][2]:19.2f}x"
        )
    if cfg.profile:
        profile_decode(engine, prompts[1])
