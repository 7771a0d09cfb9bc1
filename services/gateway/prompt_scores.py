"""Prompt logprobs in the reply: vLLM's `prompt_logprobs` list, and echo's scored prompt.

`prompt_logprobs` (vLLM's shape) is one entry per prompt token: None for the first, then
`{token id: {logprob, rank, decoded_token}}` holding the prompt token and its top k. A
completion with echo and logprobs lists the prompt's tokens before the output's in
`logprobs` (tokens, token_logprobs, top_logprobs, text_offset), the first with null
logprob and top_logprobs, as OpenAI's legacy API did. With `max_tokens: 0` only the
prompt is returned: the output the worker sampled is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.prompting import ModelText
from shared.protocol import PromptTokenLogprob


@dataclass(frozen=True, slots=True)
class PromptScoring:
    first_token_id: int  # the prompt's first token, which nothing scores
    listed: bool  # prompt_logprobs asked: the reply carries vLLM's list
    echoed: bool  # completions with echo and logprobs: the prompt's tokens lead `logprobs`
    score_only: bool  # max_tokens 0: no output


def vllm_prompt_logprobs(
    text: ModelText, entries: list[PromptTokenLogprob]
) -> list[dict[str, Any] | None]:
    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": text.token_text(token_id)}

    listed: list[dict[str, Any] | None] = [None]
    for e in entries:
        best = {str(t): entry(t, lp, rank) for rank, (t, lp) in enumerate(e.top, start=1)}
        listed.append(best | {str(e.token_id): entry(e.token_id, e.logprob, e.rank)})
    return listed


def echoed_rows(
    text: ModelText, first_token_id: int, entries: list[PromptTokenLogprob]
) -> list[tuple[str, float | None, dict[str, float] | None]]:
    """(token text, logprob, top logprobs) per prompt token, for a completion's logprobs."""
    token = text.token_text
    rows: list[tuple[str, float | None, dict[str, float] | None]] = [
        (token(first_token_id), None, None)
    ]
    rows += [(token(e.token_id), e.logprob, {token(t): lp for t, lp in e.top}) for e in entries]
    return rows
