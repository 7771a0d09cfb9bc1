"""What one engine step reports per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.sampler import TokenLogprobs
from shared.engine.sequence import FinishReason, PromptLogprob


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # empty unless asked for
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # params.prompt_logprobs: with the first token, prompt tokens 1.. scored (None: not asked)
    prompt_logprobs: list[PromptLogprob] | None = None
