"""Speculative decoding with a draft model: greedy identity, lossless sampling with the
draft's own distribution q, the draft's KV catch-up (decode-side hand-off, preemption),
block accounting with aborts, a perfect draft's acceptance, and the vocabulary check."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.config import WorkerConfig
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampler import SamplingRow
from shared.engine.sampling_params import SamplingParams
from shared.engine.seeded_random import draw, uniform
from shared.engine.spec_decode.verify import DRAFT_STREAM, _rejection_sample
from tests.conftest import write_tiny_model
from tests.engine_harness import run_to_completion
from tests.unit.test_spec_decode import (
    NUM_BLOCKS,
    PROMPTS,
    SAMPLED_BIAS,
    assert_same_sampled_pairs,
    make_engine,
    run_all,
)

BIAS = SAMPLED_BIAS  # keeps the output among four tokens


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model with the same vocabulary: other weights, one layer, other widths."""
    return write_tiny_model(
        tmp_path_factory.mktemp("draft"),
        seed=1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def swapped_draft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with the embeddings (tied, so the head rows too) of tokens 5, 6 and 7, 8
    swapped: among the four tokens BIAS favours, its q is far from the target's p."""
    path = tmp_path_factory.mktemp("swapped-draft")
    tensors = load_file(tiny_model_dir / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    embed[[5, 6, 7, 8]] = embed[[7, 8, 5, 6]]
    save_file(tensors, str(path / "model.safetensors"))
    shutil.copy(tiny_model_dir / "config.json", path)
    return path


def draft_engine(target: Path, draft: Path, **overrides) -> LLMEngine:
    return make_engine(target, "draft", draft_model_dir=draft, **overrides)


def greedy(_: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logit_bias=BIAS)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_identical_with_a_draft_model(tiny_model_dir, draft_dir, k) -> None:
    reference = run_all(make_engine(tiny_model_dir, None), PROMPTS, greedy)
    engine = draft_engine(tiny_model_dir, draft_dir, num_speculative_tokens=k)
    assert run_all(engine, PROMPTS, greedy) == reference
    stats = engine.spec_stats
    assert 0 < stats.accepted < stats.proposed  # both paths taken


def test_a_perfect_draft_is_almost_always_accepted(tiny_model_dir) -> None:
    """The target as its own draft: q = p up to rounding, so greedy and sampled drafts pass."""
    engine = draft_engine(tiny_model_dir, tiny_model_dir, num_speculative_tokens=4)
    prompts = {f"{name}-{i}": p for name, p in PROMPTS.items() for i in range(4)}

    def params(request_id: str) -> SamplingParams:
        i = int(request_id.rsplit("-", 1)[1])
        return SamplingParams(temperature=0.0 if i == 0 else 0.9, seed=i, max_tokens=40)

    run_all(engine, prompts, params)
    assert engine.spec_stats.proposed > 100
    assert engine.spec_stats.acceptance_rate > 0.9


def test_rejection_sampling_with_a_draft_distribution_gives_the_target_one() -> None:
    """One step, one draft drawn from q: the first token follows p0 whatever q is; a draft is
    accepted with probability sum_x min(p0, q), and the bonus token then follows p1."""
    weights = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])  # [K + 1, V]
    p0, p1 = (weights / weights.sum(dim=1, keepdim=True)).tolist()
    q = torch.tensor([[0.55, 0.05, 0.1, 0.3]])  # [K, V]: far from p0
    params = SamplingParams(temperature=1.0)
    firsts: Counter[int] = Counter()
    bonus: Counter[int] = Counter()
    trials = 4000
    for seed in range(trials):
        rows = [SamplingRow(params, seed, 10 + i, [1], []) for i in range(2)]
        u = torch.tensor([uniform(seed, 10, DRAFT_STREAM)], dtype=torch.float64)
        drafted = int(draw(q, u)[0])
        tokens = _rejection_sample(weights, rows, [drafted], q)
        firsts[tokens[0]] += 1
        if len(tokens) == 2:
            bonus[tokens[1]] += 1
    accept = sum(min(a, b) for a, b in zip(p0, q[0].tolist(), strict=True))
    expected = {("first", t): p for t, p in enumerate(p0)}
    expected |= {("bonus", t): accept * p for t, p in enumerate(p1)}
    for (kind, token), p in expected.items():  # within 4.5 standard deviations
        seen = (firsts if kind == "first" else bonus)[token] / trials
        assert abs(seen - p) < 4.5 * math.sqrt(p * (1 - p) / trials), (kind, token)


def test_sampled_token_frequencies_match_plain_decoding(tiny_model_dir, swapped_draft_dir):
    """Many seeded runs with and without the draft model: for each pair of consecutive
    output positions the histograms of token pairs pass a two-sample chi-square test
    (p = 0.001). The draft's q is far from the target's p (acceptance ~0.5), so accepting
    with probability p instead of p / q, or drawing a rejection from p rather than from
    max(0, p - q), fails this test."""
    engine = draft_engine(tiny_model_dir, swapped_draft_dir, num_speculative_tokens=3)
    assert_same_sampled_pairs(make_engine(tiny_model_dir, None), engine)
    assert 0.3 < engine.spec_stats.acceptance_rate < 0.8


def test_decode_side_draft_catches_up_on_an_imported_prompt(tiny_model_dir, draft_dir) -> None:
    """The prefill engine sends the target's KV only; the draft model computes its own KV
    for the prompt at the first proposal, and the output is plain decoding's."""
    prompt = [(7 * i) % 250 + 3 for i in range(37)]
    reference = run_all(make_engine(tiny_model_dir, None), {"r": prompt}, greedy)["r"]
    prefill = make_engine(tiny_model_dir, None)
    decode = draft_engine(tiny_model_dir, draft_dir, num_speculative_tokens=3)
    prefill.add_request("r", prompt, greedy("r"), hold_kv=True)
    first = run_to_completion(prefill)["r"]
    decode.reserve("r", prompt, greedy("r"))
    decode.import_kv("r", prefill.export_kv("r"))
    prefill.release("r")
    seq = decode.requests["r"]
    decode.start_decode("r", first[0])
    assert seq.num_draft_computed_tokens == 0 and seq.num_computed_tokens == len(prompt)
    output = decode.step()[0].new_token_ids
    assert seq.num_draft_computed_tokens > len(prompt)  # the prompt, then the accepted drafts
    assert seq.num_draft_computed_tokens <= seq.num_computed_tokens
    assert first + output + run_to_completion(decode)["r"] == reference
    assert decode.block_manager.num_free_blocks == NUM_BLOCKS


def test_preemption_and_aborts_with_a_draft_model_leak_no_blocks(tiny_model_dir, draft_dir):
    """A cache too small for every sequence: preemption frees blocks (and the draft's KV
    count) mid-speculation, the preempted sequences recompute and still decode exactly;
    aborting the rest mid-run gives every block back."""
    prompts = {f"{name}-{i}": p for name, p in PROMPTS.items() for i in range(3)}
    reference = run_all(make_engine(tiny_model_dir, None), prompts, greedy)
    engine = draft_engine(tiny_model_dir, draft_dir, num_kv_blocks=40)
    assert run_to_completion(engine) == {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(request_id))
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    preempted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        preempted |= len(engine.scheduler.waiting) > 0 and engine.spec_stats.verify_steps > 0
    assert preempted
    assert outputs == reference
    assert engine.block_manager.num_free_blocks == 40

    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(request_id))
    for _ in range(6):
        engine.step()
    for request_id in prompts:
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 40


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path) -> None:
    other = write_tiny_model(tmp_path / "other", vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary of 128 tokens"):
        draft_engine(tiny_model_dir, other)
    # Same size, other tokenizer: refused when both directories have a tokenizer.json.
    target, draft = (write_tiny_model(tmp_path / name) for name in ("target", "draft"))
    for path, first in ((target, "a"), (draft, "b")):
        vocab = {first: 0} | {f"t{i}": i for i in range(1, 256)}
        (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(ValueError, match="different tokenizers"):
        draft_engine(target, draft)


def test_configs_pair_the_draft_method_with_a_draft_model(tiny_model_dir, draft_dir) -> None:
    with pytest.raises(ValueError, match="needs a draft_model_dir"):
        EngineConfig(model_dir=tiny_model_dir, speculative="draft")
    with pytest.raises(ValueError, match="needs a draft_model_dir"):
        EngineConfig(model_dir=tiny_model_dir, speculative="ngram", draft_model_dir=draft_dir)
    drafting = EngineConfig(tiny_model_dir, speculative="draft", draft_model_dir=draft_dir)
    for role, speculates in (("prefill", False), ("decode", True), ("both", True)):
        worker = WorkerConfig(worker_id="w", role=role, model_name="tiny", engine=drafting)
        engine = worker.engine_config()  # a prefill worker never speculates: no draft loads
        assert (engine.speculative, engine.draft_model_dir) == (
            ("draft", draft_dir) if speculates else (None, None)
        )
