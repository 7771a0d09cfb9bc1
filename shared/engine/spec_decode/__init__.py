"""Speculative decoding: propose K draft tokens cheaply, verify them in one forward pass.

A step for a decoding sequence with drafts d1..dK (EngineConfig.speculative):
1. the scheduler reserves room for K drafts (`proposer.Proposer.max_drafts`), then the
   proposer fills them for the whole batch at once: `ngram` looks the sequence's latest
   n-gram up earlier in its own tokens (prompt lookup) and proposes what followed it;
   `draft` runs a smaller model of the same vocabulary K times (`draft.py`);
2. the verify chunk is K + 1 tokens: the last real token, then the drafts; the runner
   computes it like a prefill chunk and keeps the logits of all K + 1 rows;
3. `verify.verify_drafts` accepts a prefix of the drafts and adds one token (the correction
   at the first rejection, or a bonus token when all pass): greedy rows keep exactly the
   tokens plain decoding would give; sampling rows use rejection sampling (Leviathan et al.)
   against the proposal's distribution, so the output distribution is the target's;
4. the engine keeps the KV of the accepted tokens and gives back the blocks that only held
   rejected ones (`BlockManager.truncate`).
Requests with a grammar (structured output) or held for KV export get no drafts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpecDecodeStats:
    proposed: int = 0  # draft tokens put into verify chunks
    accepted: int = 0  # of those, accepted
    verify_steps: int = 0  # verify chunks computed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0
