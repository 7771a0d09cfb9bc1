"""`Sequence`: the one object that carries a request through the engine, with the small types
it holds (its status, finish reason and prompt-logprob entries).

The one rule: a `Sequence` is compared by identity, one object per request, so sets and
lists of them never confuse two requests with equal tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.structured_output import GrammarState


class SequenceStatus(IntEnum):
    WAITING = 0  # queued; holds no blocks (or only prefix-cache hits while being admitted)
    RUNNING = 1  # scheduled every step: prefill chunks, then one decode token a step
    HELD = 2  # prefill done and first token sampled; KV kept for export until released
    RESERVED = 3  # decode side: blocks reserved, waiting for the prefill worker's KV
    FINISHED = 4


class FinishReason(IntEnum):
    STOP = 0  # eos or a stop token id
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # aborted by the caller


@dataclass(slots=True)
class PromptLogprob:
    """One prompt token's score under the logits of the position before it (prompt_logprobs.py)."""

    token_id: int
    logprob: float
    rank: int  # 1: the most likely token at its position
    top: list[tuple[int, float]]  # the params.prompt_logprobs best (token id, logprob)


@dataclass(slots=True, eq=False)  # one object per request: compared by identity
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by every output token so far
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # effective seed: params.seed, or one the engine drew at admission
    hold_kv: bool = False  # prefill role: stop after the first token and keep the KV
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of its committed full blocks
    # The chained hash of every full block of token_ids, computed or not: each is hashed once,
    # the list extended as tokens are appended (BlockManager.hashes); tokens never change.
    token_block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_draft_computed_tokens: int = 0  # draft model: tokens whose draft KV is in its cache
    finish_reason: FinishReason | None = None
    grammar: GrammarState | None = None  # structured output: where the output is in its grammar
    # params.prompt_logprobs: entry j scores prompt token j + 1 (prompt_logprobs.py)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
