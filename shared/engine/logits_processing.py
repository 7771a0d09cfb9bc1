"""Logits processing before the sampler's choice, in the order the sampler applies it.

Per row, in place, and only for the rows that ask for it (`needs_processing`):
logit_bias → min_tokens (eos and stop ids masked) → repetition penalty (HF rule, over
prompt and output) → frequency and presence penalties (OpenAI rule, over the output).
Then, batched over the rows that sample: temperature → top_k → top_p → min_p, giving
weights proportional to the probabilities the draw uses (`truncated_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from shared.engine.sampling_params import SamplingParams

# top_p looks for its cut among the 256 best tokens, then the 4096 best, then all of them.
_TOP_P_CANDIDATES = (256, 4096)


def needs_processing(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether `process_row` would change this row's logits (bias, min_tokens, penalties)."""
    return (
        bool(params.logit_bias) or params.needs_penalties or num_output_tokens < params.min_tokens
    )


def process_row(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    eos_token_ids: Sequence[int],
) -> None:
    """Apply bias, min_tokens and penalties to one row of logits ([V] float32) in place."""
    if params.logit_bias:
        apply_logit_bias(logits, params.logit_bias)
    if len(output_token_ids) < params.min_tokens:
        # Keep the request from stopping early; with ignore_eos, eos does not stop it (vLLM).
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        mask_tokens(logits, (*eos, *params.stop_token_ids))
    if params.repetition_penalty != 1.0:
        seen = [*prompt_token_ids, *output_token_ids]
        apply_repetition_penalty(logits, _ids(seen, logits), params.repetition_penalty)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        apply_frequency_presence_penalties(
            logits,
            _ids(output_token_ids, logits),
            params.frequency_penalty,
            params.presence_penalty,
        )


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """logits: [V]. Adds bias[t] to logit t; ids outside the vocabulary are ignored."""
    vocab = logits.shape[0]
    pairs = [(t, b) for t, b in bias.items() if t < vocab]
    if pairs:
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
        values = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, ids, values)


def mask_tokens(logits: torch.Tensor, token_ids: Iterable[int]) -> None:
    """logits: [V]. Sets the given tokens' logits to -inf; ids outside the vocabulary ignored."""
    ids = [t for t in token_ids if t < logits.shape[0]]
    if ids:
        logits[_ids(ids, logits)] = float("-inf")


def apply_repetition_penalty(logits: torch.Tensor, token_ids: torch.Tensor, penalty: float) -> None:
    """logits: [V]; token_ids: [L] (repeats allowed). HF rule: a seen token's positive logit
    is divided by the penalty, a negative one multiplied."""
    seen = logits[token_ids]  # [L]; repeats read and write the same value
    logits[token_ids] = torch.where(seen > 0, seen / penalty, seen * penalty)


def apply_frequency_presence_penalties(
    logits: torch.Tensor, output_ids: torch.Tensor, frequency: float, presence: float
) -> None:
    """logits: [V]; output_ids: [L]. OpenAI rule: logit -= frequency*count + presence*(count>0)."""
    ids, counts = torch.unique(output_ids, return_counts=True)  # [U], [U]
    logits.index_add_(0, ids, -(frequency * counts.to(logits.dtype) + presence))


def truncated_weights(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, top_p and min_p, for rows that sample (temperature > 0).

    logits: [M, V] float32, one row per params. Returns [M, V] float32 weights proportional
    to each row's final probabilities: the best token has weight 1, dropped tokens 0.
    Ties at a top_k or top_p cut are all kept.
    """
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)  # [M]
    best = logits.amax(dim=-1, keepdim=True)  # [M, 1]
    weights = torch.exp((logits - best) / temperature[:, None])  # [M, V], max exactly 1

    top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        ks = [params[i].top_k for i in top_k]
        k = torch.tensor(ks, device=logits.device)  # [K]
        _keep_from(weights, top_k, lambda w: _kth_largest(w, k, max(ks)))
    top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        nucleus = torch.tensor([params[i].top_p for i in top_p], device=logits.device)  # [P]
        _keep_from(weights, top_p, lambda w: _top_p_cut(w, nucleus))
    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        # The best token has weight 1, so min_p * max prob is min_p in weight units.
        cut = torch.tensor([params[i].min_p for i in min_p], device=logits.device)  # [Q]
        _keep_from(weights, min_p, lambda w: cut.to(w.dtype))
    return weights


def _keep_from(
    weights: torch.Tensor, rows: list[int], cut_of: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Zero, in the given rows of weights [M, V], every weight below that row's cut [R]."""
    if len(rows) == weights.shape[0]:
        weights.masked_fill_(weights < cut_of(weights)[:, None], 0.0)
        return
    index = torch.tensor(rows, device=weights.device)  # [R]
    sub = weights[index]  # [R, V]
    weights[index] = sub.masked_fill_(sub < cut_of(sub)[:, None], 0.0)


def _kth_largest(weights: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """weights: [R, V]; k: [R] in [1, V], at most max_k. Returns [R], each row's k-th largest."""
    top = weights.topk(max_k, dim=-1).values  # [R, max_k], descending
    return top.gather(1, (k - 1)[:, None]).squeeze(1)


def _top_p_cut(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """weights: [R, V]; top_p: [R]. Returns [R], the weight of the token at which the mass of
    the best tokens, taken best first, first reaches top_p (the smallest such nucleus)."""
    total = weights.sum(dim=-1, dtype=torch.float64)  # [R]
    needed = top_p.double() * total  # [R]
    cut = torch.empty_like(total, dtype=weights.dtype)  # [R]
    pending = torch.arange(weights.shape[0], device=weights.device)  # rows still without a cut
    for size in (*_TOP_P_CANDIDATES, weights.shape[1]):
        best = weights[pending].topk(min(size, weights.shape[1]), dim=-1).values  # [R', size]
        through = best.cumsum(dim=-1, dtype=torch.float64)  # [R', size], mass up to each token
        before = F.pad(through[:, :-1], (1, 0))  # [R', size], mass of the better tokens
        kept = (before < needed[pending, None]).sum(dim=-1)  # [R'] >= 1, since top_p > 0
        found = (kept < best.shape[1]) | (through[:, -1] >= needed[pending])
        found |= size >= weights.shape[1]
        cut[pending[found]] = best[found].gather(1, (kept[found] - 1)[:, None]).squeeze(1)
        pending = pending[~found]
        if pending.numel() == 0:
            break
    return cut


def _ids(token_ids: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(token_ids, dtype=torch.long, device=like.device)
