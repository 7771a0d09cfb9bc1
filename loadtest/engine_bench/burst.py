"""`splitserve bench burst`: a burst of prompts prefilled by the engine alone, as a prefill
worker would (each request wants its first token only), timed per step and in all.

`bench peers` measures the last first token of a burst through the whole mesh; this takes
the mesh away, so the difference between the two is what the mesh adds (the hand-off, the
decode worker's steps, the hops), and the rest is the engine's.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import CPU_TOKEN_BUDGET, EngineConfig
from shared.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class BurstBenchConfig:
    model_dir: Path
    prompts: int = 16
    prompt_len: int = 100  # tokens each: bench peers' 100 random words are 100 tokens
    max_num_batched_tokens: int = CPU_TOKEN_BUDGET  # the engine's default
    threads: tuple[int, ...] = (1, 2)
    trials: int = 2
    dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class BurstTiming:
    threads: int
    step_ms: list[float]

    @property
    def total_ms(self) -> float:
        return sum(self.step_ms)

    def line(self, prompts: int, prompt_len: int) -> str:
        steps = " ".join(f"{ms:.0f}" for ms in self.step_ms)
        return (
            f"{prompts} x {prompt_len} tokens, {self.threads} thread(s): last first token after "
            f"{self.total_ms:.0f} ms, {len(self.step_ms)} steps (ms: {steps})"
        )


def time_burst(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[float]:
    """Add every prompt at once (one token each, greedy), step until all are done; the
    wall time of each step in ms."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - began) * 1e3)
    return steps


def run_burst_bench(config: BurstBenchConfig) -> list[BurstTiming]:
    engine = LLMEngine(
        EngineConfig(
            model_dir=config.model_dir,
            dtype=config.dtype,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=False,  # every trial computes its prompts afresh
        )
    )
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def burst(n: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(config.prompt_len)] for _ in range(n)]

    time_burst(engine, burst(2), "warm-up")
    timings = []
    for threads in config.threads:
        torch.set_num_threads(threads)
        for trial in range(config.trials):
            steps = time_burst(engine, burst(config.prompts), f"t{threads}-{trial}")
            timing = BurstTiming(threads, steps)
            print(timing.line(config.prompts, config.prompt_len), flush=True)
            timings.append(timing)
    return timings
