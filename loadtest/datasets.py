"""Datasets for the open-loop runner, as in `vllm bench serve`.

- random: random token ids, fixed input and output lengths (prompts sent as token ids).
- shared-prefix: groups of requests that share a random prefix, then a random suffix.
- sharegpt: a ShareGPT-format JSON file (first human turn as prompt, the reply's length
  as output length unless one is given).
- multi-turn: conversations of `num_turns` turns over one long shared system prompt
  (`prefix_len` tokens); turn t re-sends the system prompt and every earlier turn (user
  `input_len` tokens, a stand-in reply of `output_len` tokens) then its own user turn, as a
  chat client does. Requests come turn by turn (every conversation's turn 1, then turn 2...),
  so with `--max-concurrency` a turn's history was served before it. Each request is
  labelled with its turn (`multi-turn t<N>`): the report adds TTFT by turn.
- mooncake: trace replay from JSONL lines `{timestamp (ms), input_length, output_length,
  hash_ids}`; each hash id stands for one block of `block_size` tokens, equal ids give
  equal tokens, so the trace's prefix sharing is kept.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadtest.request import BenchRequest

LOW_TOKEN_ID = 100  # tokenizers keep their special tokens among the low ids


@dataclass(slots=True, frozen=True)
class DatasetConfig:
    name: str = "random"  # random | shared-prefix | multi-turn | sharegpt | mooncake
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    vocab_size: int = 32000
    prefix_len: int = 512  # shared-prefix: tokens of each group's prefix
    num_prefixes: int = 4  # shared-prefix: groups
    num_turns: int = 8  # multi-turn: turns per conversation (num_prompts in all)
    path: Path | None = None  # sharegpt / mooncake file
    block_size: int = 512  # mooncake: tokens per hash id
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in LOADERS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {sorted(LOADERS)}")
        if self.name in ("sharegpt", "mooncake") and self.path is None:
            raise ValueError(f"dataset {self.name} needs a file (--dataset-path)")
        if self.num_turns < 1:
            raise ValueError("num_turns must be positive")
        if self.vocab_size <= LOW_TOKEN_ID:
            raise ValueError("vocab_size must exceed 100")


def estimate_tokens(text: str) -> int:
    """About four characters a token for English text, when no tokenizer is at hand."""
    return max(1, len(text) // 4)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(LOW_TOKEN_ID, vocab) for _ in range(n)]


def random_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    rng = random.Random(cfg.seed)
    return [
        BenchRequest(
            _tokens(rng, cfg.input_len, cfg.vocab_size),
            cfg.input_len,
            cfg.output_len,
            label="random",
        )
        for _ in range(cfg.num_prompts)
    ]


def shared_prefix_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    rng = random.Random(cfg.seed)
    prefixes = [_tokens(rng, cfg.prefix_len, cfg.vocab_size) for _ in range(cfg.num_prefixes)]
    out = []
    for i in range(cfg.num_prompts):
        prompt = prefixes[i % cfg.num_prefixes] + _tokens(rng, cfg.input_len, cfg.vocab_size)
        out.append(BenchRequest(prompt, len(prompt), cfg.output_len, label="shared-prefix"))
    return out


def multi_turn_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    rng = random.Random(cfg.seed)
    system = _tokens(rng, cfg.prefix_len, cfg.vocab_size)
    num_conversations = max(1, cfg.num_prompts // cfg.num_turns)
    histories = [list(system) for _ in range(num_conversations)]
    out = []
    for turn in range(1, cfg.num_turns + 1):
        for history in histories:
            prompt = history + _tokens(rng, cfg.input_len, cfg.vocab_size)
            label = f"multi-turn t{turn}"  # the report's TTFT by turn (by_label.py)
            out.append(BenchRequest(prompt, len(prompt), cfg.output_len, label=label))
            history[:] = prompt + _tokens(rng, cfg.output_len, cfg.vocab_size)  # the reply
    return out


def sharegpt_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    assert cfg.path is not None
    rows = json.loads(cfg.path.read_text())
    random.Random(cfg.seed).shuffle(rows)
    out = []
    for row in rows:
        turns = row.get("conversations") or row.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        output_len = cfg.output_len if cfg.output_len > 0 else estimate_tokens(reply)
        out.append(BenchRequest(prompt, estimate_tokens(prompt), output_len, label="sharegpt"))
        if len(out) == cfg.num_prompts:
            break
    return out


def mooncake_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    assert cfg.path is not None
    blocks: dict[int, list[int]] = {}
    out = []
    for line in cfg.path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        prompt: list[int] = []
        for hash_id in row.get("hash_ids", []):
            if hash_id not in blocks:
                rng = random.Random(f"{cfg.seed}-{hash_id}")
                blocks[hash_id] = _tokens(rng, cfg.block_size, cfg.vocab_size)
            prompt += blocks[hash_id]
        length = int(row["input_length"])
        rng = random.Random(f"{cfg.seed}-tail-{len(out)}")
        prompt = (prompt + _tokens(rng, max(0, length - len(prompt)), cfg.vocab_size))[:length]
        out.append(
            BenchRequest(
                prompt,
                length,
                int(row["output_length"]),
                timestamp=float(row["timestamp"]) / 1000,
                label="mooncake",
            )
        )
        if len(out) == cfg.num_prompts:
            break
    return out


LOADERS = {
    "random": random_requests,
    "shared-prefix": shared_prefix_requests,
    "multi-turn": multi_turn_requests,
    "sharegpt": sharegpt_requests,
    "mooncake": mooncake_requests,
}


def load_dataset(cfg: DatasetConfig) -> list[BenchRequest]:
    return LOADERS[cfg.name](cfg)
