"""The workloads of `splitserve bench slo`: one rate's requests, as token ids, for a seed.

- chat: ShareGPT-like lengths: prompt and reply drawn from log-normal distributions whose
  medians (128 and 120 tokens, σ = 1: means near the ~215 and ~200 of vLLM's ShareGPT set)
  are clipped to [4, 1024] and [4, 512] tokens.
- long: `long_len` (2048) prompt tokens → 128 (loadtest/datasets.py: random).
- agent: one 1024-token system prompt shared by every request, then a 64-token turn → 64
  (datasets.py: shared-prefix).
- mixed: agent turns and long prompts, alternating: the short, cached requests the decode
  worker could prefill itself beside the long ones worth a prefill worker.
- mooncake: a synthetic trace in Mooncake's format (`timestamp` ms, `input_length`,
  `output_length`, `hash_ids` of 128-token blocks; 4 documents whose leading blocks requests
  share, then blocks of their own), written as JSONL and replayed by datasets.py's loader.
- gen: a 128-token prompt → 512 tokens (code or text generation: decode-heavy).
- shift: Poisson arrivals over `phases` phases of `phase_seconds` each, each phase's
  requests of one kind of `shift_mix` in turn (chat, long, chat, … by default: a phase
  of gen against one of long is a shift between the decode side's work and the prefill
  side's); its request count is the rate × the phases' length, not `num_prompts`.

The one subtle rule: mooncake and shift carry their own send times (the open-loop runner
takes timestamps over the rate), drawn at the rate asked; the others are sent at that rate
by the runner's own Poisson arrivals. Everything else is a function of the seed alone.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.arrivals import gamma_offsets
from loadtest.datasets import (
    LOW_TOKEN_ID,
    DatasetConfig,
    mooncake_requests,
    random_requests,
    shared_prefix_requests,
)
from loadtest.request import BenchRequest
from loadtest.slo.config import WORKLOADS


@dataclass(frozen=True, slots=True)
class Lengths:
    """A clipped log-normal length distribution, in tokens."""

    median: int
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return min(
            self.high, max(self.low, round(rng.lognormvariate(math.log(self.median), self.sigma)))
        )


CHAT_PROMPT = Lengths(128, 1.0, 4, 1024)
CHAT_REPLY = Lengths(120, 1.0, 4, 512)
LONG_PROMPT, LONG_REPLY = 2048, 128
GEN_PROMPT, GEN_REPLY = 128, 512
AGENT_SYSTEM, AGENT_TURN, AGENT_REPLY = 1024, 64, 64
MOONCAKE_BLOCK = 128  # tokens per hash id
MOONCAKE_DOCUMENTS = 4  # shared prefixes
MOONCAKE_SHARED_BLOCKS = 8  # a request shares 1..8 leading blocks of its document
MOONCAKE_OWN_BLOCKS = 4  # then 1..4 blocks of its own
MOONCAKE_REPLY = Lengths(64, 0.8, 4, 256)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_prompts: int  # per rate (not shift's)
    vocab_size: int  # token ids are drawn from [LOW_TOKEN_ID, vocab_size)
    phase_seconds: float = 120.0  # shift
    phases: int = 2  # shift
    trace_dir: Path | None = None  # mooncake: where its traces go (None: a temporary dir)
    long_len: int = LONG_PROMPT  # long, mixed and shift: a long prompt's tokens
    shift_mix: tuple[str, ...] = ("chat", "long")  # shift: the phases' kinds, in turn


def workload_requests(name: str, spec: WorkloadSpec, rate: float, seed: int) -> list[BenchRequest]:
    """Workload `name`'s requests for one run at `rate` requests per second."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    data = DatasetConfig(num_prompts=spec.num_prompts, vocab_size=spec.vocab_size, seed=seed)
    if name in ("chat", "gen"):
        rng = random.Random(seed)
        return [_one(name, rng, spec) for _ in range(spec.num_prompts)]
    if name == "long":
        requests = random_requests(replace(data, input_len=spec.long_len, output_len=LONG_REPLY))
    elif name == "agent":
        requests = shared_prefix_requests(_agent(data))
    elif name == "mixed":
        return mixed_requests(spec, data)
    elif name == "mooncake":
        path = _trace_path(spec.trace_dir, f"mooncake-s{seed}-r{rate:g}.jsonl")
        rows = mooncake_trace(spec.num_prompts, rate, seed)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        trace = replace(data, name="mooncake", path=path, block_size=MOONCAKE_BLOCK)
        requests = mooncake_requests(trace)
    else:
        return shift_requests(spec, rate, seed)
    return [replace(r, label=name) for r in requests]


def _agent(data: DatasetConfig) -> DatasetConfig:
    return replace(
        data,
        name="shared-prefix",
        input_len=AGENT_TURN,
        output_len=AGENT_REPLY,
        prefix_len=AGENT_SYSTEM,
        num_prefixes=1,
    )


def mixed_requests(spec: WorkloadSpec, data: DatasetConfig) -> list[BenchRequest]:
    """Agent turns (even positions) and long prompts (odd), `num_prompts` in all; the long
    prompts are drawn from another seed, so none begins with the agent's system prompt."""
    agent = shared_prefix_requests(replace(_agent(data), num_prompts=(spec.num_prompts + 1) // 2))
    long_data = replace(data, num_prompts=spec.num_prompts // 2, seed=data.seed + 1)
    long = random_requests(replace(long_data, input_len=spec.long_len, output_len=LONG_REPLY))
    mixed = [replace(r, label="agent") for r in agent] + [replace(r, label="long") for r in long]
    mixed[::2], mixed[1::2] = mixed[: len(agent)], mixed[len(agent) :]
    return mixed


def mooncake_trace(num: int, rate: float, seed: int) -> list[dict[str, object]]:
    """`num` rows of a Mooncake-format trace, Poisson at `rate`: requests share their
    document's leading blocks (ids below DOCUMENTS × SHARED_BLOCKS), then have their own."""
    rng = random.Random(seed)
    next_id = MOONCAKE_DOCUMENTS * MOONCAKE_SHARED_BLOCKS
    rows = []
    for offset in gamma_offsets(num, rate, 1.0, seed):
        document = rng.randrange(MOONCAKE_DOCUMENTS)
        shared = rng.randint(1, MOONCAKE_SHARED_BLOCKS)
        own = rng.randint(1, MOONCAKE_OWN_BLOCKS)
        ids = [document * MOONCAKE_SHARED_BLOCKS + i for i in range(shared)]
        ids += range(next_id, next_id + own)
        next_id += own
        rows.append(
            {
                "timestamp": round(offset * 1000),
                "input_length": len(ids) * MOONCAKE_BLOCK - rng.randrange(MOONCAKE_BLOCK),
                "output_length": MOONCAKE_REPLY.draw(rng),
                "hash_ids": ids,
            }
        )
    return rows


def shift_requests(spec: WorkloadSpec, rate: float, seed: int) -> list[BenchRequest]:
    """Poisson arrivals over the phases; phase i's requests are of kind shift_mix[i % len]."""
    rng = random.Random(seed)
    horizon = spec.phases * spec.phase_seconds
    requests, t = [], 0.0
    while t < horizon:
        kind = spec.shift_mix[int(t // spec.phase_seconds) % len(spec.shift_mix)]
        requests.append(replace(_one(kind, rng, spec), timestamp=t))
        t += rng.expovariate(rate)
    return requests


def _one(kind: str, rng: random.Random, spec: WorkloadSpec) -> BenchRequest:
    """One request of a shift kind (chat, long or gen)."""
    if kind == "chat":
        prompt_len, reply_len = CHAT_PROMPT.draw(rng), CHAT_REPLY.draw(rng)
    elif kind == "long":
        prompt_len, reply_len = spec.long_len, LONG_REPLY
    else:
        prompt_len, reply_len = GEN_PROMPT, GEN_REPLY
    return _request(rng, spec.vocab_size, prompt_len, reply_len, kind)


def _request(
    rng: random.Random, vocab_size: int, prompt_len: int, reply_len: int, label: str
) -> BenchRequest:
    prompt = [rng.randrange(LOW_TOKEN_ID, vocab_size) for _ in range(prompt_len)]
    return BenchRequest(prompt, prompt_len, reply_len, label=label)


def _trace_path(trace_dir: Path | None, name: str) -> Path:
    directory = trace_dir or Path(tempfile.mkdtemp(prefix="splitserve-slo-"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name
