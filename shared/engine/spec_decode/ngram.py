"""N-gram prompt lookup: draft tokens copied from where the sequence's tail occurred before."""

from __future__ import annotations

from shared.engine.sequence import Sequence
from shared.engine.spec_decode.proposer import Drafts, Proposer


class NgramProposer(Proposer):
    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[Drafts]:
        return [Drafts(propose(seq.token_ids, k)) for seq, k in zip(seqs, num_drafts, strict=True)]


def propose(token_ids: list[int], k: int, max_n: int = 3, min_n: int = 2) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, trying n = max_n down to min_n; [] when no such n-gram occurs earlier."""
    length = len(token_ids)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        last = suffix[-1]
        # start + n <= length - 1: at least one token follows the occurrence. Latest first.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start + n - 1] == last and token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []
