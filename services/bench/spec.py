"""`splitserve bench spec`: n-gram speculative decoding on a repetitive workload.

Chat prompts that make the model copy from its prompt (edit a given piece of code, repeat or
lightly rework a given text). One request at a time, greedy, as in single-stream decoding:
decode tok/s after the first token without and with `--speculative ngram`, the acceptance
rate, tokens per verify step, and whether the outputs are identical (they should be).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams

CODE = """def moving_average(values, window):
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result
"""
TEXT = (
    "The river rises in the hills to the north and runs south through farmland for about "
    "forty miles before it reaches the town. In spring the water is high and fast, and the "
    "old stone bridge is sometimes closed. In late summer the river is slow and shallow, "
    "and children wade across it near the mill. The town council plans to build a new "
    "bridge next year, paid for by a small tax on the market."
)
TASKS = [
    f"Rename the function to rolling_mean and the variable total to running_sum. "
    f"Reply with the whole code only.\n\n{CODE}",
    f"Add a docstring to this function and reply with the whole code only.\n\n{CODE}",
    f"Repeat the following text exactly, then say 'Done.'\n\n{TEXT}",
    f"Rewrite the following text, replacing 'river' with 'stream'.\n\n{TEXT}",
]


@dataclass(slots=True, frozen=True)
class SpecBenchConfig:
    model_dir: Path
    k: int = 4
    max_tokens: int = 160
    num_threads: int | None = None
    quantization: str | None = None


def decode(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy output of one request and its decode seconds after the first token."""
    engine.add_request("spec-bench", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens = list(engine.step()[0].new_token_ids)  # prefill and the first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens, time.perf_counter() - start


def run_spec_bench(cfg: SpecBenchConfig) -> None:
    from services.bench.quant import encode_chat

    prompts = encode_chat(cfg.model_dir, TASKS)
    engines = {
        name: LLMEngine(
            EngineConfig(
                model_dir=cfg.model_dir,
                num_kv_blocks=256,
                num_threads=cfg.num_threads,
                quantization=cfg.quantization,
                speculative=spec,
                num_speculative_tokens=cfg.k,
            )
        )
        for name, spec in (("plain", None), ("ngram", "ngram"))
    }
    for engine in engines.values():
        decode(engine, prompts[0][:32], 8)  # warm-up
    weights = cfg.quantization or "fp32"
    print(f"model {cfg.model_dir} {weights}; n-gram K={cfg.k}; {len(TASKS)} copy/edit tasks")
    print(
        f"{'task':5} {'tokens':>6} {'plain tok/s':>12} {'ngram tok/s':>12} {'speed-up':>9} "
        f"{'accept':>7} {'tok/step':>9} {'same':>5}"
    )
    totals = {"plain": [0, 0.0], "ngram": [0, 0.0]}
    spec = engines["ngram"].spec_stats
    for index, prompt in enumerate(prompts):
        before = (spec.proposed, spec.accepted, spec.verify_steps)
        plain_tokens, plain_s = decode(engines["plain"], prompt, cfg.max_tokens)
        spec_tokens, spec_s = decode(engines["ngram"], prompt, cfg.max_tokens)
        proposed, accepted, steps = (
            now - then
            for now, then in zip(
                (spec.proposed, spec.accepted, spec.verify_steps), before, strict=True
            )
        )
        n = len(plain_tokens) - 1
        totals["plain"][0] += n
        totals["plain"][1] += plain_s
        totals["ngram"][0] += len(spec_tokens) - 1
        totals["ngram"][1] += spec_s
        print(
            f"{index:5} {n:6} {n / plain_s:12.1f} {(len(spec_tokens) - 1) / spec_s:12.1f} "
            f"{plain_s / spec_s * (len(spec_tokens) - 1) / max(n, 1):8.2f}x "
            f"{accepted / max(proposed, 1):7.2f} {(accepted + steps) / max(steps, 1):9.2f} "
            f"{plain_tokens == spec_tokens!s:>5}"
        )
    plain_rate = totals["plain"][0] / totals["plain"][1]
    spec_rate = totals["ngram"][0] / totals["ngram"][1]
    print(
        f"all: plain {plain_rate:.1f} tok/s, ngram {spec_rate:.1f} tok/s "
        f"({spec_rate / plain_rate:.2f}x); acceptance {spec.acceptance_rate:.2f} "
        f"({spec.accepted}/{spec.proposed} drafts)"
    )
