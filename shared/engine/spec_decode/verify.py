"""Verification of draft tokens against the target model's logits, lossless.

For a verify chunk, row i of the logits (i = 0..K) predicts the token after the last real
token and drafts d1..di. Each row is processed exactly as the sampler would process it had
d1..di already been output (penalties, min_tokens, bias), so the target distribution p_i
is the one plain decoding would draw from.
- greedy: accept while argmax p_i == d(i+1); the first mismatch's argmax (or, all accepted,
  row K's) is the extra token: the output is token for token plain greedy decoding's.
- sampling: the n-gram proposal is a point mass, q_i(d) = 1, so accept d with probability
  min(1, p_i(d) / q_i(d)) = p_i(d); on rejection draw from the residual max(0, p_i - q_i),
  which is p_i without d. Randomness stays a pure function of (seed, position, stream):
  ACCEPT_STREAM for the test, RESIDUAL_STREAM for the residual draw, and the sampler's own
  stream 0 for the bonus token.
"""

from __future__ import annotations

import torch

from shared.engine.logits_processing import truncated_weights
from shared.engine.sampler import SampledToken, Sampler, SamplingRow
from shared.engine.seeded_random import draw, uniform
from shared.engine.sequence import Sequence

ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2


def verify_drafts(
    logits: torch.Tensor, seq: Sequence, drafts: list[int], sampler: Sampler
) -> list[SampledToken]:
    """logits: [K + 1, V'] for the last real token and the K drafts of `seq`.
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
        token_ids = _rejection_sample(
            truncated_weights(processed, [seq.params] * (k + 1)), rows, drafts
        )
    logprobs = sampler.logprobs(logits[: len(token_ids)], token_ids, rows[: len(token_ids)])
    return [SampledToken(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]


def _rejection_sample(
    weights: torch.Tensor, rows: list[SamplingRow], drafts: list[int]
) -> list[int]:
    """weights: [K + 1, V] >= 0, proportional to the target probabilities p_i."""
    probs = weights / weights.sum(dim=-1, keepdim=True)  # [K + 1, V]
    for i, draft in enumerate(drafts):
        row = rows[i]
        p, q = probs[i, draft].item(), 1.0  # q: the proposal's probability of its own draft
        # p >= q: always accept the draft token; otherwise accept with probability p / q.
        if uniform(row.seed, row.position, ACCEPT_STREAM) < p / q:
            continue
        residual = weights[i].clone()  # max(0, p - q): p with the draft's mass taken out
        residual[draft] = 0.0
        u = torch.tensor([uniform(row.seed, row.position, RESIDUAL_STREAM)], dtype=torch.float64)
        return [*drafts[:i], int(draw(residual[None], u)[0])]
    last = rows[-1]
    u = torch.tensor([uniform(last.seed, last.position)], dtype=torch.float64)
    return [*drafts, int(draw(weights[-1:], u)[0])]
