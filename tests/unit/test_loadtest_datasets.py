"""Datasets and arrival schedules of the open-loop runner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadtest.arrivals import gamma_offsets, send_offsets
from loadtest.datasets import DatasetConfig, load_dataset


def test_random_lengths_and_range() -> None:
    reqs = load_dataset(
        DatasetConfig("random", num_prompts=5, input_len=64, output_len=9, vocab_size=1000)
    )
    assert len(reqs) == 5
    assert all(len(r.prompt) == 64 and r.output_len == 9 for r in reqs)
    assert all(100 <= t < 1000 for r in reqs for t in r.prompt)
    assert reqs[0].prompt != reqs[1].prompt


def test_shared_prefix_groups() -> None:
    reqs = load_dataset(
        DatasetConfig("shared-prefix", num_prompts=6, input_len=8, prefix_len=32, num_prefixes=2)
    )
    prefixes = [tuple(r.prompt[:32]) for r in reqs]
    assert len(set(prefixes)) == 2 and prefixes[0] == prefixes[2] == prefixes[4]
    assert all(len(r.prompt) == 40 for r in reqs)


def test_multi_turn_conversations_resend_their_history() -> None:
    config = DatasetConfig(
        "multi-turn", num_prompts=6, num_turns=3, input_len=4, output_len=5, prefix_len=32
    )
    reqs = load_dataset(config)
    assert len(reqs) == 6  # 2 conversations x 3 turns, turn by turn
    system = reqs[0].prompt[:32]
    assert all(r.prompt[:32] == system for r in reqs)  # one system prompt for all
    first, second = reqs[0].prompt, reqs[2].prompt  # conversation 0, turns 1 and 2
    assert second[: len(first)] == first and len(second) == len(first) + 5 + 4
    assert reqs[1].prompt[32:36] != first[32:36]  # another conversation
    assert [len(r.prompt) for r in reqs] == [36, 36, 45, 45, 54, 54]
    assert all(r.output_len == 5 and r.prompt_len == len(r.prompt) for r in reqs)
    assert [r.label for r in reqs] == [f"multi-turn t{t}" for t in (1, 1, 2, 2, 3, 3)]


def test_sharegpt(tmp_path: Path) -> None:
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "Hi " * 40},
                {"from": "gpt", "value": "Hello " * 20},
            ]
        },
        {"conversations": [{"from": "human", "value": "lonely"}]},  # skipped: no reply
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))
    reqs = load_dataset(DatasetConfig("sharegpt", num_prompts=10, output_len=0, path=path))
    assert len(reqs) == 1
    assert reqs[0].prompt == "Hi " * 40 and reqs[0].output_len == 30  # 120 chars / 4


def test_mooncake_hash_ids_share_blocks(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 1000, "input_length": 20, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 1500, "input_length": 12, "output_length": 3, "hash_ids": [7, 9]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    a, b = load_dataset(DatasetConfig("mooncake", path=path, block_size=10))
    assert (len(a.prompt), len(b.prompt), a.output_len) == (20, 12, 5)
    assert a.prompt[:10] == b.prompt[:10] and a.prompt[10:] != b.prompt[10:12]
    assert send_offsets([a, b], rate=1.0, burstiness=1.0) == pytest.approx([0.0, 0.5])


def test_dataset_config_checks() -> None:
    with pytest.raises(ValueError, match="needs a file"):
        DatasetConfig("sharegpt")
    with pytest.raises(ValueError, match="unknown dataset"):
        DatasetConfig("nope")


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals_follow_rate_and_burstiness(burstiness: float) -> None:
    offsets = np.array(gamma_offsets(20000, rate=8.0, burstiness=burstiness, seed=1))
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)
    # gamma with shape k: coefficient of variation 1 / sqrt(k) (1 for Poisson)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_at_once() -> None:
    assert gamma_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
