"""Is a request one the engine could ever serve? Checks that any thread may run.

`RequestChecker` holds only limits fixed at start (vocabulary, context, cache size) and the
grammar compilers, whose cache is guarded by their own lock, so the worker may check a
request on its event loop or a thread pool while the engine's thread is inside `step`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.errors import InvalidRequest
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured_output import GrammarCompilers, GrammarState


@dataclass(frozen=True, slots=True)
class RequestChecker:
    vocab_size: int  # the model's: every token id is in [0, vocab_size)
    max_model_len: int  # a request's tokens stay below it
    block_size: int
    num_blocks: int  # the whole KV cache: a request's worst case must fit in it
    grammars: GrammarCompilers

    def check(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> GrammarState | None:
        """InvalidRequest naming the field at fault, or the request's grammar matcher advanced
        over `output_token_ids` (None without structured output)."""
        vocab, max_len = self.vocab_size, self.max_model_len
        if not prompt_token_ids:
            raise InvalidRequest("prompt_token_ids", "prompt must contain at least one token")
        for field, ids in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
        ):
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequest(field, f"token ids must be in [0, {vocab})")
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        if num_tokens >= max_len:
            reason = f"prompt has {num_tokens} tokens; the model's context is {max_len}"
            raise InvalidRequest("prompt_token_ids", reason)
        worst_case = min(max_len, len(prompt_token_ids) + params.max_tokens)
        if -(-worst_case // self.block_size) > self.num_blocks:
            reason = (
                f"{worst_case} tokens need more KV blocks than the cache has "
                f"({self.num_blocks}); lower max_tokens or raise the cache size"
            )
            raise InvalidRequest("max_tokens", reason)
        if not params.guided_kind:
            return None
        compiled = self.grammars.compile(params.guided_kind, params.guided_spec)
        grammar = GrammarState(compiled, self.grammars.vocab_size)
        grammar.replay(output_token_ids)
        return grammar
