"""What the scheduler hands the model runner for one step (and `BatchScheduler.update` after it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # new tokens computed for `seq` this step, from seq.num_computed_tokens on
    # Speculative decoding: a verify chunk is the last real token then these K draft tokens
    # (num_tokens = K + 1); every row is sampled (spec_decode/verify.py).
    draft_token_ids: list[int] = field(default_factory=list)
    # [K, V]: the draft model's probabilities each draft was drawn from (sampling requests);
    # None: each draft is a point mass (n-gram lookup, or greedy)
    draft_probs: torch.Tensor | None = None

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        end = self.seq.num_computed_tokens + self.num_tokens - len(self.draft_token_ids)
        return end == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    # decodes first, then verify chunks (speculative decoding) and prefills
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # blocks freed, back in waiting

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)
