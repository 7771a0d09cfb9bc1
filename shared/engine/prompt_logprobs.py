"""Prompt logprobs: each prompt token's logprob under the logits of the position before it.

A request with `prompt_logprobs` set computes its whole prompt (no prefix-cache hits:
`block_manager.allocate`) and its prefill chunks want the logits of every row
(`model_runner`). Row q scores prompt token q + 1; the last prompt row is the one the first
token is sampled from, and scores nothing. Each entry holds the token's logprob and rank
under log_softmax of the raw logits (the sampler's convention for `logprobs`) and the
params.prompt_logprobs best; the first prompt token has none. A chunk recomputed after a
preemption scores nothing twice.
"""

from __future__ import annotations

import torch

from shared.engine.sequence import PromptLogprob, Sequence


def wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
    """Does a chunk from position `start` have rows that score prompt tokens?"""
    return seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1


def score_prompt(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """logits: [n, V] raw, the rows of positions start .. start + n - 1. Appends the entries
    they score to seq.prompt_logprobs (entry j is prompt token j + 1's)."""
    first = max(start, len(seq.prompt_logprobs))  # positions before are scored already
    end = min(start + logits.shape[0], seq.num_prompt_tokens - 1)  # position end scores nothing
    if first >= end:
        return
    logprobs = torch.log_softmax(logits[first - start : end - start].float(), dim=-1)  # [m, V]
    targets = torch.tensor(seq.token_ids[first + 1 : end + 1], device=logits.device)  # [m]
    chosen = logprobs.gather(1, targets[:, None])  # [m, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    k = seq.params.prompt_logprobs or 0
    top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)  # values, indices: [m, k]
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    for j, (token_id, logprob) in enumerate(
        zip(targets.tolist(), chosen[:, 0].tolist(), strict=True)
    ):
        best = list(zip(top_ids[j], top_values[j], strict=True))
        seq.prompt_logprobs.append(PromptLogprob(token_id, logprob, ranks[j], best))
