"""Verification of draft tokens against the target model's logits, lossless.

For a verify chunk, row i of the logits (i = 0..K) predicts the token after the last real
token and drafts d1..di. Each row is processed exactly as the sampler would process it had
d1..di already been output (penalties, min_tokens, bias), so the target distribution p_i
is the one plain decoding would draw from.
- greedy: accept while argmax p_i == d(i+1); the first mismatch's argmax (or, all accepted,
  row K's) is the extra token: the output is token for token plain greedy decoding's.
- sampling: rejection sampling (Leviathan et al.) against the proposal q_i that d(i+1) was
  drawn from: accept it with probability min(1, p_i(d) / q_i(d)); on rejection draw from the
  residual normalize(max(0, p_i - q_i)); all accepted, the bonus token comes from p_K.
  A draft model's q_i is its own processed distribution (spec_decode/draft.py); an n-gram
  draft is a point mass, q_i(d) = 1, so d is accepted with probability p_i(d) and the
  residual is p_i without d. Randomness stays a pure function of (seed, position, stream):
  ACCEPT_STREAM for the test, RESIDUAL_STREAM for the residual draw, the sampler's own
  stream 0 for the bonus token, and DRAFT_STREAM for the draft model's own draws.
"""

from __future__ import annotations

import torch

from shared.engine.logits_processing import truncated_weights
from shared.engine.sampler import SampledToken, Sampler, SamplingRow
from shared.engine.seeded_random import draw, uniform
from shared.engine.sequence import Sequence

ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2
DRAFT_STREAM = 3


def verify_drafts(
    logits: torch.Tensor,
    seq: Sequence,
    drafts: list[int],
    sampler: Sampler,
    draft_probs: torch.Tensor | None = None,
) -> list[SampledToken]:
    """logits: [K + 1, V'] for the last real token and the K drafts of `seq`; draft_probs:
    [K, V], the proposal each draft was drawn from, or None for point masses.
    Returns the accepted drafts followed by one more token (1 to K + 1 tokens)."""
    k = len(drafts)
    outputs = seq.output_token_ids
    rows = [
        SamplingRow(
            params=seq.params,
            seed=seq.seed,
            position=seq.num_tokens + i,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=outputs + drafts[:i],
        )
        for i in range(k + 1)
    ]
    logits = logits[:, : sampler.vocab_size]  # [K + 1, V]
    processed = sampler.process(logits, rows)  # [K + 1, V]
    if seq.params.greedy:
        target = processed.argmax(dim=-1).tolist()  # [K + 1]
        n = next((i for i in range(k) if target[i] != drafts[i]), k)
        token_ids = [*drafts[:n], target[n]]
    else:
        weights = truncated_weights(processed, [seq.params] * (k + 1))
        token_ids = _rejection_sample(weights, rows, drafts, draft_probs)
    logprobs = sampler.logprobs(logits[: len(token_ids)], token_ids, rows[: len(token_ids)])
    return [SampledToken(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]


def _rejection_sample(
    weights: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[int],
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """weights: [K + 1, V] >= 0, proportional to the target probabilities p_i; draft_probs:
    [K, V], the proposals q_i (rows summing to 1), or None for point masses on the drafts."""
    probs = weights / weights.sum(dim=-1, keepdim=True)  # [K + 1, V]
    for i, draft in enumerate(drafts):
        row = rows[i]
        p = probs[i, draft].item()
        q = 1.0 if draft_probs is None else draft_probs[i, draft].item()  # > 0: d was drawn
        # p >= q: always accept the draft token; otherwise accept with probability p / q.
        if uniform(row.seed, row.position, ACCEPT_STREAM) < p / q:
            continue
        if draft_probs is None:  # max(0, p - q) for a point mass: p with the draft taken out
            residual = probs[i].clone()
            residual[draft] = 0.0
        else:
            residual = (probs[i] - draft_probs[i]).clamp_(min=0.0)
            if not residual.sum() > 0:  # p == q up to rounding: p itself is the residual
                residual = probs[i]
        u = torch.tensor(
            [uniform(row.seed, row.position, RESIDUAL_STREAM)],
            dtype=torch.float64,
            device=probs.device,
        )  # [1]
        return [*drafts[:i], int(draw(residual[None], u)[0])]
    last = rows[-1]
    u = torch.tensor(
        [uniform(last.seed, last.position)], dtype=torch.float64, device=weights.device
    )  # [1]
    return [*drafts, int(draw(weights[-1:], u)[0])]
