"""Appending sampled tokens to a sequence, and the rules that say when it is done."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.outputs import RequestOutput
from shared.engine.sampler import SampledToken
from shared.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True, slots=True)
class StopRules:
    eos_token_ids: tuple[int, ...]  # the model's; ignored by params.ignore_eos
    max_model_len: int  # no sequence grows past the model's context

    def finish_reason(self, seq: Sequence) -> FinishReason | None:
        """Why `seq` is done now that its last token is appended, or None if it is not."""
        token, params = seq.token_ids[-1], seq.params
        if (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.eos_token_ids)
            or (seq.grammar is not None and seq.grammar.is_terminated)
        ):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def append_tokens(seq: Sequence, tokens: list[SampledToken], rules: StopRules) -> RequestOutput:
    """Append `tokens` to `seq` (and its grammar) in order, up to the first that finishes it;
    one output for all those appended. Statuses and blocks are the caller's (BatchScheduler)."""
    output = RequestOutput(
        request_id=seq.request_id,
        new_token_ids=[],
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
    )
    for sampled in tokens:
        seq.token_ids.append(sampled.token_id)
        if seq.grammar is not None:
            seq.grammar.accept(sampled.token_id)
        output.new_token_ids.append(sampled.token_id)
        if sampled.logprobs:
            output.new_logprobs.append(sampled.logprobs)
        output.finish_reason = rules.finish_reason(seq)
        if output.finish_reason is not None:
            break
    return output
