"""Speculative decoding (n-gram prompt lookup): the proposer, lossless verification (greedy
identity, sampled distributions), limits and block accounting, on the tiny model."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampler import SamplingRow
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec_decode import ngram
from shared.engine.spec_decode.verify import _rejection_sample

NUM_BLOCKS = 96
PROMPTS = {
    "loop": [5, 6, 7, 8] * 6,
    "mixed": [9, 10, 11] * 5 + [3, 4, 9, 10],
    "plain": list(range(3, 30)),
}


def make_engine(model_dir, speculative: str | None, **overrides) -> LLMEngine:
    config = {"num_kv_blocks": NUM_BLOCKS, "block_size": 4, "max_num_seqs": 512, "num_threads": 1}
    config |= {"max_num_batched_tokens": 4096, **overrides}
    return LLMEngine(EngineConfig(model_dir=model_dir, speculative=speculative, **config))


def run_all(engine: LLMEngine, prompts: dict[str, list[int]], params) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params(request_id))
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS  # rolled-back blocks came back
    return outputs


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # latest match wins
    assert ngram.propose([4, 2, 3, 5, 1, 3, 6, 2, 3], 3) == [5, 1, 3]  # "2 3" beats "3"
    assert ngram.propose([1, 2, 1], 4, min_n=1) == [2, 1]  # short tail: what there is
    assert ngram.propose([1, 2, 1], 4) == []  # unigrams are not tried by default
    assert ngram.propose([1, 2, 3], 4) == []  # no earlier occurrence
    assert ngram.propose([1, 1], 0) == []


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_identical_with_and_without_drafts(tiny_model_dir, k: int) -> None:
    def greedy(_):
        return SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    reference = run_all(make_engine(tiny_model_dir, None), PROMPTS, greedy)
    engine = make_engine(tiny_model_dir, "ngram", num_speculative_tokens=k)
    assert run_all(engine, PROMPTS, greedy) == reference
    stats = engine.spec_stats
    assert stats.proposed > 0 and 0 < stats.accepted < stats.proposed  # both paths taken
    assert stats.verify_steps > 0


def test_limits_stop_tokens_and_logprobs_hold_with_drafts(tiny_model_dir) -> None:
    def params(request_id):
        return SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2)

    reference = run_all(make_engine(tiny_model_dir, None), PROMPTS, params)
    engine = make_engine(tiny_model_dir, "ngram", num_speculative_tokens=4)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, params(request_id))
    tokens: dict[str, list[int]] = {r: [] for r in PROMPTS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert [lp.token_id for lp in out.new_logprobs] == out.new_token_ids
            tokens[out.request_id] += out.new_token_ids
    assert tokens == reference and all(len(t) == 7 for t in tokens.values())
    # A stop token met among accepted drafts ends the request right there.
    stop = reference["loop"][3]
    stopped = run_all(
        make_engine(tiny_model_dir, "ngram"),
        {"loop": PROMPTS["loop"]},
        lambda _: SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop,)),
    )
    assert stopped["loop"] == reference["loop"][: reference["loop"].index(stop) + 1]


def test_rejection_sampling_draws_from_the_target_distribution() -> None:
    """One step with one draft: the first token follows row 0; after an accepted draft, the
    bonus token follows row 1 (the joint is p0(draft) * p1)."""
    weights = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])  # [K + 1, V]
    p0, p1 = (weights / weights.sum(dim=1, keepdim=True)).tolist()
    params = SamplingParams(temperature=1.0)
    firsts: Counter[int] = Counter()
    bonus: Counter[int] = Counter()
    trials = 4000
    for seed in range(trials):
        rows = [SamplingRow(params, seed, 10 + i, [1], []) for i in range(2)]
        tokens = _rejection_sample(weights, rows, [2])
        firsts[tokens[0]] += 1
        if len(tokens) == 2:
            bonus[tokens[1]] += 1
    expected = {("first", t): p for t, p in enumerate(p0)}
    expected |= {("bonus", t): p0[2] * p for t, p in enumerate(p1)}
    for (kind, token), p in expected.items():  # within 4.5 standard deviations
        seen = (firsts if kind == "first" else bonus)[token] / trials
        assert abs(seen - p) < 4.5 * math.sqrt(p * (1 - p) / trials), (kind, token)


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


SAMPLED_BIAS = {5: 10.0, 6: 10.0, 7: 10.0, 8: 10.0}  # output among the prompt's tokens


def assert_same_sampled_pairs(
    plain_engine: LLMEngine, spec_engine: LLMEngine, runs: int = 800, length: int = 6
) -> None:
    """`runs` seeded requests on each engine (different seeds): for each pair of consecutive
    output positions the histograms of token pairs pass a two-sample chi-square test
    (p = 0.001). SAMPLED_BIAS keeps the output among the prompt's tokens."""

    def sampled(offset: int):
        def params(request_id: str) -> SamplingParams:
            seed = offset + int(request_id)
            return SamplingParams(
                max_tokens=length, seed=seed, logit_bias=SAMPLED_BIAS, ignore_eos=True
            )

        return params

    prompts = {str(i): [5, 6, 7, 8] * 3 for i in range(runs)}
    plain = run_all(plain_engine, prompts, sampled(0))
    spec = run_all(spec_engine, prompts, sampled(100_000))
    for position in range(1, length):
        a = Counter((out[position - 1], out[position]) for out in plain.values())
        b = Counter((out[position - 1], out[position]) for out in spec.values())
        keys = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 5]
        stat = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in keys)
        assert stat < chi2_critical(max(1, len(keys) - 1)), (position, a, b)


def test_sampled_token_frequencies_match_plain_decoding(tiny_model_dir) -> None:
    """Many seeded runs with and without drafts: for each pair of consecutive output
    positions, the histograms of token pairs pass a two-sample chi-square test (p = 0.001).
    A logit bias keeps the output among the prompt's tokens, so the n-gram drafts are often
    right but not always (acceptance ~0.2). Accepting with probability sqrt(p) instead of p
    fails this test; so does accepting every draft."""
    engine = make_engine(tiny_model_dir, "ngram", num_speculative_tokens=3)
    assert_same_sampled_pairs(make_engine(tiny_model_dir, None), engine)
    assert 0.1 < engine.spec_stats.acceptance_rate < 0.5
