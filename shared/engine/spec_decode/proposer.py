"""Proposers: where draft tokens come from, behind the one interface the scheduler calls.

The scheduler asks `max_drafts(seq)` for each decoding sequence, reserves slots for that
many drafts, then calls `propose` once for all of them; a proposer may return fewer drafts
than asked (the scheduler gives the rest of the room back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from shared.engine.sequence import Sequence


@dataclass(slots=True)
class Drafts:
    token_ids: list[int]
    # [len(token_ids), V]: the distribution each draft was drawn from, for verification;
    # None when every draft is a point mass (n-gram lookup, greedy requests)
    probs: torch.Tensor | None = None


class Proposer(ABC):
    def __init__(self, num_speculative_tokens: int, max_model_len: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len

    def max_drafts(self, seq: Sequence) -> int:
        """Drafts a decoding `seq` may get: none for guided or held requests, and never more
        than the request may still output or the context may still hold."""
        if seq.grammar is not None or seq.hold_kv or not seq.num_output_tokens:
            return 0
        return max(
            0,
            min(
                self.num_speculative_tokens,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            ),
        )

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[Drafts]:
        """At most num_drafts[i] (>= 1) drafts for seqs[i], whose block tables have slots for
        its last token and that many drafts."""
