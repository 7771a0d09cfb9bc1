"""What one engine step reports: per request its new tokens (`RequestOutput`), and the
transitions the engine made (`StepOutput`), so its users keep no state machine of their own.

The one subtle rule: a request's transitions come in the same `StepOutput` as the output
that caused them (a held request's blocks with its first token), so nothing has to ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.kv_handoff import HeldBlocks
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


@dataclass(slots=True)
class StepOutput:
    outputs: list[RequestOutput] = field(default_factory=list)  # new tokens and finishes
    started: list[str] = field(default_factory=list)  # ids whose first chunk this step ran
    # prefill side: ids held after this step's first token, with the blocks kept for export
    held: dict[str, HeldBlocks] = field(default_factory=dict)
    num_prompt_tokens: int = 0  # prompt tokens this step computed (stats.step_shape)
    num_decode_rows: int = 0  # sequences it decoded one token (and drafts) for
