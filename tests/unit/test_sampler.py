"""The sampler against hand-computed logits processing, masks, frequencies and logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.logits_processing import (
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    process_row,
    truncated_weights,
)
from shared.engine.sampler import Sampler, SamplingRow
from shared.engine.sampling_params import SamplingParams
from shared.engine.seeded_random import draw, uniform

EOS = 2


def row(
    params: SamplingParams,
    seed: int = 0,
    position: int = 0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
) -> SamplingRow:
    return SamplingRow(params, seed, position, prompt or [0], output or [])


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], eos: tuple[int, ...] = (EOS,)
) -> list[int]:
    """logits: [N, V]. The sampled token ids."""
    return [s.token_id for s in Sampler(logits.shape[1], eos)(logits, rows)]


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 7) -> np.ndarray:
    """logits: [V]. n draws of one request at positions 0..n-1, batched in one call."""
    batch = logits[None, :].expand(n, -1)  # [n, V]
    return np.array(sample(batch, [row(params, seed, p) for p in range(n)]))


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


# seeded randomness


def test_uniform_is_a_pure_function_in_unit_interval() -> None:
    values = [uniform(3, p) for p in range(20_000)]
    assert values == [uniform(3, p) for p in range(20_000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(np.mean(values) - 0.5) < 0.01
    assert np.histogram(values, bins=10, range=(0, 1))[0].min() > 1_800
    assert uniform(3, 5) != uniform(4, 5)
    assert uniform(3, 5) != uniform(3, 6)
    assert uniform(3, 5) != uniform(3, 5, stream=1)
    with pytest.raises(ValueError):
        uniform(-1, 0)


def test_draw_edges_never_pick_zero_weight() -> None:
    weights = torch.tensor([[0.0, 1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0, 1.0]])  # [2, 5]
    first = draw(weights, torch.zeros(2, dtype=torch.float64))
    last = draw(weights, torch.full((2,), 1.0 - 2.0**-53, dtype=torch.float64))
    assert first.tolist() == [1, 2]
    assert last.tolist() == [2, 4]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.0, 1e-30, 1e-6, 0.3, 1.0, 7.0]), min_size=1, max_size=40),
    st.floats(min_value=0.0, max_value=1.0 - 2.0**-53),
)
def test_draw_lands_on_positive_weight(weights: list[float], u: float) -> None:
    w = torch.tensor([[*weights, 1.0]])  # [1, V]; one positive weight at least
    chosen = draw(w, torch.tensor([u], dtype=torch.float64)).item()
    assert w[0, chosen] > 0


# greedy and determinism


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))  # [5, 300]
    logits[4, 10] = logits[4, 20] = logits[4].max() + 1
    rows = [row(SamplingParams(temperature=0.0), seed=i, position=i) for i in range(5)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()
    assert sample(logits, rows)[4] == 10


def test_seeded_draw_ignores_batch_row_index_and_global_rng() -> None:
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(1000, generator=gen) * 0.5  # [V] flat enough to spread the draws
    params = SamplingParams(temperature=0.9, top_p=0.95)
    alone = sample(target[None, :], [row(params, seed=42, position=17)])[0]
    neighbours = [
        (SamplingParams(temperature=0.0), 1, 3),
        (SamplingParams(temperature=1.3, top_k=5), 42, 18),
        (SamplingParams(min_p=0.1, repetition_penalty=1.5), 42, 17),
        (SamplingParams(top_p=0.5, logprobs=3), 9, 17),
    ]
    for index in range(len(neighbours) + 1):
        torch.manual_seed(index)
        others = torch.randn(len(neighbours), 1000, generator=gen)  # [4, V]
        logits = torch.cat([others[:index], target[None, :], others[index:]])  # [5, V]
        rows = [row(p, seed=s, position=pos) for p, s, pos in neighbours]
        rows.insert(index, row(params, seed=42, position=17))
        assert sample(logits, rows)[index] == alone


def test_different_positions_and_seeds_draw_differently() -> None:
    logits = torch.zeros(1000)  # [V] uniform
    by_position = draws(logits, SamplingParams(), 50, seed=5)
    by_seed = [
        sample(logits[None, :], [row(SamplingParams(), seed=s, position=0)])[0] for s in range(50)
    ]
    assert len(set(by_position.tolist())) > 40
    assert len(set(by_seed)) > 40


# truncation: top_k, top_p, min_p


def test_truncated_weights_hand_computed() -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])[None, :]  # [1, 4]

    def kept(**kwargs: float) -> list[int]:
        weights = truncated_weights(logits, [SamplingParams(**kwargs)])  # [1, 4]
        return torch.nonzero(weights[0]).flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.75) == [0, 1]
    assert kept(top_p=0.85) == [0, 1, 2]
    assert kept(min_p=0.2) == [0, 1, 2]  # keeps p >= 0.1
    assert kept(min_p=0.5) == [0, 1]  # keeps p >= 0.25
    weights = truncated_weights(logits, [SamplingParams(top_k=2)])[0]
    torch.testing.assert_close(weights, torch.tensor([1.0, 0.6, 0.0, 0.0]))


def test_top_p_applies_to_the_top_k_renormalized_distribution() -> None:
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])[None, :]  # [1, 4]
    # After top_k=3 the masses are 4/9, 3/9, 2/9: the first two already reach 0.75.
    both = truncated_weights(logits, [SamplingParams(top_k=3, top_p=0.75)])
    alone = truncated_weights(logits, [SamplingParams(top_p=0.75)])
    assert torch.nonzero(both[0]).flatten().tolist() == [0, 1]
    assert torch.nonzero(alone[0]).flatten().tolist() == [0, 1, 2]


def reference_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """logits: [V]. The kept-token mask of the smallest best-first nucleus, in float64."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    cut = probs[order][np.count_nonzero(before < top_p) - 1]
    return probs >= cut


def test_top_p_cut_found_at_every_candidate_depth() -> None:
    vocab = 5000
    flat = -torch.arange(vocab, dtype=torch.float32) * 1e-4  # cut deep in the vocabulary
    peaked = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 8
    cases = [
        (peaked, 0.9),
        (flat, 0.02),
        (flat, 0.5),
        (flat, 0.9),
    ]  # cuts found among 256, 4096, all
    logits = torch.stack([c[0] for c in cases])  # [4, V]
    weights = truncated_weights(logits, [SamplingParams(top_p=p) for _, p in cases])
    for i, (case, top_p) in enumerate(cases):
        expected = reference_top_p(case.double().numpy(), top_p)
        assert np.array_equal((weights[i] > 0).numpy(), expected), i
    kept = [int((w > 0).sum()) for w in weights]
    assert kept[0] < 256 and kept[1] < 256 < kept[2] <= 4096 < kept[3]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.5), {0, 1}),
        (SamplingParams(min_p=0.5), {0, 1, 2}),
        (SamplingParams(temperature=1.5, top_k=4, top_p=0.9, min_p=0.5), {0, 1, 2}),
    ],
)
def test_masked_tokens_never_drawn_and_kept_tokens_are(
    params: SamplingParams, allowed: set[int]
) -> None:
    logits = probs_logits([0.3, 0.25, 0.2, 0.1, 0.08, 0.07])  # [6]
    drawn = set(draws(logits, params, 2000).tolist())
    assert drawn == allowed


# processing: logit_bias, min_tokens, penalties


def test_process_row_hand_computed() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])  # [V=5]
    params = SamplingParams(
        logit_bias={0: 2.0, 3: -5.0, 4: 10.0, 99: 1.0},  # 99 is outside the vocabulary
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    process_row(logits, params, [0, 1], [1, 2, 2], eos_token_ids=(EOS,))
    # bias: [4, -1, .5, -2, 8]; repetition over {0, 1, 2}: [2, -2, .25, -2, 8];
    # frequency/presence over counts {1: 1, 2: 2}: token 1 -= .75, token 2 -= 1.25.
    torch.testing.assert_close(logits, torch.tensor([2.0, -2.75, -1.0, -2.0, 8.0]))


def test_repetition_penalty_counts_each_token_once() -> None:
    logits = torch.tensor([4.0, -4.0, 1.0])
    apply_repetition_penalty(logits, torch.tensor([0, 0, 1, 1, 1]), 1.6)
    torch.testing.assert_close(logits, torch.tensor([2.5, -6.4, 1.0]))


def test_frequency_and_presence_penalties() -> None:
    logits = torch.zeros(4)
    apply_frequency_presence_penalties(logits, torch.tensor([3, 1, 3, 3]), 0.5, -1.0)
    torch.testing.assert_close(logits, torch.tensor([0.0, 0.5, 0.0, -0.5]))


def test_penalties_steer_greedy_and_leave_input_and_logprobs_raw() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0], [5.0, 4.0, 1.0, 0.0]])  # [2, 4]
    raw = logits.clone()
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=1)
    rows = [row(penalised, output=[0]), row(SamplingParams(temperature=0.0, logprobs=1))]
    out = Sampler(4, (EOS,))(logits, rows)
    assert [s.token_id for s in out] == [1, 0]  # 5 / 1.5 < 4
    assert torch.equal(logits, raw)
    expected = torch.log_softmax(raw[0], dim=-1)
    assert out[0].logprobs is not None
    assert out[0].logprobs.logprob == pytest.approx(expected[1].item())


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 2.0]])  # [1, 5]: eos 2 and stop 3 lead
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    assert sample(logits, [row(params, output=[1])]) == [4]
    assert sample(logits, [row(params, output=[1, 1])]) == [2]
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    assert sample(logits, [row(ignoring, output=[1])]) == [2]  # eos does not stop it anyway


# frequencies


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (SamplingParams(temperature=0.7), [True] * 8),
        (SamplingParams(temperature=1.3, top_k=6, min_p=0.2), [True] * 5 + [False] * 3),
    ],
)
def test_sampled_frequencies_match_softmax(params: SamplingParams, keep: list[bool]) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])  # [V=8]
    n = 4000
    counts = np.bincount(draws(logits, params, n, seed=11), minlength=8)
    probs = torch.softmax(logits.double() / params.temperature, dim=-1).numpy()
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    assert probs[~np.array(keep)].sum() == 0 and counts[~np.array(keep)].sum() == 0
    expected = n * probs
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - expected) <= 5 * sigma + 1e-9)
    chi2 = float(np.sum((counts - expected)[keep] ** 2 / expected[keep]))
    assert chi2 < 30.0  # chi-square, at most 7 degrees of freedom: p < 1e-4


# logprobs and shapes


def test_logprobs_are_raw_log_softmax_sorted_and_k_long() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))  # [3, 50]
    rows = [
        row(
            SamplingParams(temperature=1.2, top_k=3, logprobs=5, frequency_penalty=1.0), output=[7]
        ),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams()),
    ]
    out = Sampler(50, (EOS,))(logits, rows)
    expected = torch.log_softmax(logits.double(), dim=-1)  # [3, 50]
    first, second = out[0].logprobs, out[1].logprobs
    assert first is not None and second is not None and out[2].logprobs is None
    assert first.token_id == out[0].token_id
    assert first.logprob == pytest.approx(expected[0, out[0].token_id].item(), abs=1e-5)
    assert [t for t, _ in first.top] == expected[0].topk(5).indices.tolist()
    for token, logprob in first.top:
        assert logprob == pytest.approx(expected[0, token].item(), abs=1e-5)
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    assert second.top == []
    assert second.logprob == pytest.approx(expected[1].max().item(), abs=1e-5)


def test_padded_vocabulary_columns_are_never_sampled() -> None:
    logits = torch.zeros(2, 12)  # [2, 12]: a vocabulary of 10 plus 2 padding columns
    logits[:, 10:] = 50.0
    rows = [row(SamplingParams(temperature=0.0, logprobs=2)), row(SamplingParams(), position=3)]
    out = Sampler(10, (EOS,))(logits, rows)
    assert all(s.token_id < 10 for s in out)
    assert out[0].logprobs is not None
    assert out[0].logprobs.logprob == pytest.approx(-math.log(10))


def test_shape_mismatch_raises() -> None:
    sampler = Sampler(10, (EOS,))
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 10), [row(SamplingParams())])
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, 9), [row(SamplingParams())])
