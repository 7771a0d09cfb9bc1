"""The workloads of `splitserve bench slo`: each one's lengths, its prefix sharing where it has
one, its send times where it carries them, and the same requests for the same seed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from loadtest.datasets import LOW_TOKEN_ID
from loadtest.slo.config import SloBenchConfig, parse_configs
from loadtest.slo.workloads import (
    AGENT_SYSTEM,
    CHAT_PROMPT,
    CHAT_REPLY,
    GEN_PROMPT,
    GEN_REPLY,
    MOONCAKE_BLOCK,
    WORKLOADS,
    WorkloadSpec,
    workload_requests,
)
from shared.errors import ConfigError

VOCAB = 1000


def spec(tmp_path: Path, num: int = 200, **kwargs: object) -> WorkloadSpec:
    return WorkloadSpec(num, VOCAB, trace_dir=tmp_path, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_workload_is_the_same_for_a_seed_and_another_for_another(tmp_path, name):
    s = spec(tmp_path, 20, phase_seconds=10.0)
    first = workload_requests(name, s, 1.0, seed=7)
    assert first == workload_requests(name, s, 1.0, seed=7)
    assert first != workload_requests(name, s, 1.0, seed=8)
    for request in first:
        assert isinstance(request.prompt, list) and len(request.prompt) == request.prompt_len
        assert all(LOW_TOKEN_ID <= t < VOCAB for t in request.prompt)
        assert request.output_len >= 1


def test_chat_lengths_follow_sharegpt_like_log_normals(tmp_path):
    requests = workload_requests("chat", spec(tmp_path, 400), 1.0, seed=1)
    prompts = [r.prompt_len for r in requests]
    replies = [r.output_len for r in requests]
    assert min(prompts) >= CHAT_PROMPT.low and max(prompts) <= CHAT_PROMPT.high
    assert min(replies) >= CHAT_REPLY.low and max(replies) <= CHAT_REPLY.high
    assert statistics.median(prompts) == pytest.approx(CHAT_PROMPT.median, rel=0.2)
    assert statistics.median(replies) == pytest.approx(CHAT_REPLY.median, rel=0.2)
    assert max(prompts) > 3 * CHAT_PROMPT.median  # a long tail, not one length
    assert all(r.timestamp is None for r in requests)  # sent at the runner's rate


def test_long_prompts_and_the_agents_shared_system_prompt(tmp_path):
    long = workload_requests("long", spec(tmp_path, 5), 1.0, seed=1)
    assert {(r.prompt_len, r.output_len) for r in long} == {(2048, 128)}
    agent = workload_requests("agent", spec(tmp_path, 5), 1.0, seed=1)
    system = agent[0].prompt[:AGENT_SYSTEM]
    assert all(r.prompt[:AGENT_SYSTEM] == system for r in agent)
    assert len({tuple(r.prompt[AGENT_SYSTEM:]) for r in agent}) == 5  # turns of their own
    assert {r.label for r in long + agent} == {"long", "agent"}


def test_mixed_alternates_cached_agent_turns_and_long_prompts_of_the_length_asked(tmp_path):
    mixed = workload_requests("mixed", spec(tmp_path, 7, long_len=300), 1.0, seed=3)
    assert [r.label for r in mixed] == ["agent", "long"] * 3 + ["agent"]
    system = mixed[0].prompt[:AGENT_SYSTEM]
    assert all(r.prompt[:AGENT_SYSTEM] == system for r in mixed[::2])
    long = mixed[1::2]
    assert {(r.prompt_len, r.output_len) for r in long} == {(300, 128)}
    assert all(r.prompt[:16] != system[:16] for r in long)  # no hit on the agent's prefix
    assert len({tuple(r.prompt) for r in long}) == 3


def test_mooncake_writes_a_trace_that_the_loader_replays_with_its_shared_blocks(tmp_path):
    requests = workload_requests("mooncake", spec(tmp_path, 60), 2.0, seed=3)
    (trace,) = tmp_path.glob("mooncake-*.jsonl")
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == len(requests) == 60
    for row, request in zip(rows, requests, strict=True):
        assert request.prompt_len == row["input_length"] == len(request.prompt)
        assert request.output_len == row["output_length"]
        assert request.timestamp == row["timestamp"] / 1000
    by_first_block: dict[int, list[int]] = {}
    for row, request in zip(rows, requests, strict=True):
        first = request.prompt[:MOONCAKE_BLOCK]
        assert by_first_block.setdefault(row["hash_ids"][0], first) == first  # same id, tokens
    assert len(by_first_block) <= 4  # every request starts in one of the documents
    stamps = [r.timestamp for r in requests]
    assert stamps == sorted(stamps) and stamps[-1] == pytest.approx(59 / 2.0, rel=0.4)


def test_shift_alternates_chat_and_long_phases_at_the_rate(tmp_path):
    s = spec(tmp_path, phase_seconds=30.0, phases=3)
    requests = workload_requests("shift", s, 2.0, seed=5)
    assert len(requests) == pytest.approx(2.0 * 90, rel=0.25)  # not num_prompts
    for request in requests:
        assert request.timestamp is not None and 0 <= request.timestamp < 90
        phase = int(request.timestamp // 30)
        assert request.label == ("long" if phase == 1 else "chat")
        if request.label == "long":
            assert (request.prompt_len, request.output_len) == (2048, 128)
    assert {int(r.timestamp // 30) for r in requests if r.timestamp is not None} == {0, 1, 2}


def test_shift_takes_its_phases_kinds_from_the_mix_in_turn(tmp_path):
    s = spec(tmp_path, phase_seconds=20.0, phases=4, shift_mix=("gen", "long", "chat"))
    requests = workload_requests("shift", s, 2.0, seed=7)
    kinds = {int(r.timestamp // 20): r.label for r in requests if r.timestamp is not None}
    assert kinds == {0: "gen", 1: "long", 2: "chat", 3: "gen"}
    gen = [r for r in requests if r.label == "gen"]
    assert gen and {(r.prompt_len, r.output_len) for r in gen} == {(GEN_PROMPT, GEN_REPLY)}


def test_a_shift_mix_of_an_unknown_kind_is_refused():
    with pytest.raises(ConfigError, match="--shift-mix 'chat,poetry'"):
        SloBenchConfig(configs=parse_configs("a=both:0"), shift_mix=("chat", "poetry"))


def test_an_unknown_workload_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown workload 'poetry'"):
        workload_requests("poetry", spec(tmp_path), 1.0, seed=0)
