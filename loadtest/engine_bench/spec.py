"""`splitserve bench spec`: speculative decoding on a repetitive workload.

Chat prompts that make the model copy from its prompt (edit a given piece of code, repeat or
lightly rework a given text). One request at a time, greedy, as in single-stream decoding:
decode tok/s after the first token without speculation, with `--speculative ngram` and,
given `--draft-model`, with `--speculative draft`; for each method the speed-up, the
acceptance rate, tokens per verify step, and whether the output is plain decoding's (it
should be, within the numerics caveat of docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec_decode import SpecDecodeStats
from shared.engine.spec_decode.ngram import NgramProposer
from shared.engine.spec_decode.proposer import Proposer

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
    quantization: str | None = None  # of the target's and the draft's weights
    draft_model_dir: Path | None = None  # adds the draft-model method


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
    from loadtest.engine_bench.quant import encode_chat

    prompts = encode_chat(cfg.model_dir, TASKS)
    # One engine for every method, its proposer swapped in turn: the same weights, cache and
    # numerics for all, the target's weights in memory once, and the methods interleaved
    # task by task (on a shared machine, load changes affect them alike).
    speculative = {"speculative": "ngram"}
    if cfg.draft_model_dir is not None:
        speculative = {"speculative": "draft", "draft_model_dir": cfg.draft_model_dir}
    engine = LLMEngine(
        EngineConfig(
            model_dir=cfg.model_dir,
            device="cpu",  # a CPU benchmark (threads, int8/int4)
            num_kv_blocks=256,
            num_threads=cfg.num_threads,
            quantization=cfg.quantization,
            num_speculative_tokens=cfg.k,
            **speculative,
        )
    )
    proposers: dict[str, Proposer | None] = {"plain": None}
    proposers["ngram"] = NgramProposer(cfg.k, engine.max_model_len)
    if cfg.draft_model_dir is not None:
        proposers["draft"] = engine.proposer
    for proposer in proposers.values():
        engine.scheduler.proposer = proposer
        decode(engine, prompts[0][:32], 8)  # warm-up
    weights = cfg.quantization or "fp32"
    draft = f", draft model {cfg.draft_model_dir}" if cfg.draft_model_dir else ""
    print(f"model {cfg.model_dir} {weights}{draft}; K={cfg.k}; {len(TASKS)} copy/edit tasks")
    spec_names = [name for name in proposers if name != "plain"]
    header = f"{'task':5} {'tokens':>6} {'plain tok/s':>12}"
    for name in spec_names:
        header += (
            f" | {name + ' tok/s':>12} {'speed-up':>9} {'accept':>7} {'tok/step':>9} {'same':>5}"
        )
    print(header)
    totals = {name: [0, 0.0] for name in proposers}  # tokens after the first, seconds
    spec_totals = {name: SpecDecodeStats() for name in spec_names}
    for index, prompt in enumerate(prompts):
        engine.scheduler.proposer = None
        plain_tokens, plain_s = decode(engine, prompt, cfg.max_tokens)
        n = len(plain_tokens) - 1
        totals["plain"][0] += n
        totals["plain"][1] += plain_s
        line = f"{index:5} {n:6} {n / plain_s:12.1f}"
        for name in spec_names:
            engine.scheduler.proposer = proposers[name]
            before = engine.stats().spec_decode
            tokens, seconds = decode(engine, prompt, cfg.max_tokens)
            after, total = engine.stats().spec_decode, spec_totals[name]
            stats = SpecDecodeStats(
                after.proposed - before.proposed,
                after.accepted - before.accepted,
                after.verify_steps - before.verify_steps,
            )
            total.proposed += stats.proposed
            total.accepted += stats.accepted
            total.verify_steps += stats.verify_steps
            totals[name][0] += len(tokens) - 1
            totals[name][1] += seconds
            rate = (len(tokens) - 1) / seconds
            line += (
                f" | {rate:12.1f} {rate / (n / plain_s):8.2f}x {stats.acceptance_rate:7.2f} "
                f"{(stats.accepted + stats.verify_steps) / max(stats.verify_steps, 1):9.2f} "
                f"{tokens == plain_tokens!s:>5}"
            )
        print(line)
    plain_rate = totals["plain"][0] / totals["plain"][1]
    summary = f"all: plain {plain_rate:.1f} tok/s"
    for name in spec_names:
        rate, stats = totals[name][0] / totals[name][1], spec_totals[name]
        summary += (
            f"; {name} {rate:.1f} tok/s ({rate / plain_rate:.2f}x, acceptance "
            f"{stats.acceptance_rate:.2f}: {stats.accepted}/{stats.proposed} drafts)"
        )
    print(summary)
