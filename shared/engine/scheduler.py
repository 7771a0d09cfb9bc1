"""Continuous batching: which sequences compute how many tokens in the next step.

Queues, in order: waiting → running → (finished, or back to waiting when preempted).
Each step spends a token budget (`max_num_batched_tokens`): running sequences first, oldest
first — one token for a decode, a chunk for an unfinished prompt — then waiting sequences
join while budget and `max_num_seqs` allow, a long prompt being cut into chunks across
steps. When blocks run out, the newest running sequence is preempted by recompute: its
blocks are freed and it waits again, keeping its tokens; its prefix may still be cached.
Speculative decoding: a decoding sequence may reserve room for draft tokens (never by
preempting anyone); once every running sequence is placed, the proposer fills the drafts
of all of them in one call, and what it did not propose goes back before admission.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch

    from shared.engine.spec_decode.proposer import Proposer


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


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        proposer: Proposer | None = None,  # speculative decoding: draft tokens for decodes
    ):
        self.block_manager = block_manager
        self.proposer = proposer
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in the cache (imported from a prefill worker)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` (finished, aborted or held); the caller owns its blocks from now on."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        speculating: list[ScheduledChunk] = []  # decodes with room reserved for drafts
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            num_drafts = 0
            if num_tokens == 1 and budget > 1 and self.proposer is not None:
                num_drafts = min(self.proposer.max_drafts(seq), budget - 1)
                if not self.block_manager.can_allocate_slots(seq, 1 + num_drafts):
                    num_drafts = 0  # drafts never preempt anyone
            num_tokens += num_drafts
            if not self._make_room(seq, num_tokens, out.preempted):
                break  # `seq` itself was preempted; it was the newest, so nothing follows
            self.block_manager.allocate_slots(seq, num_tokens)
            chunks.append(ScheduledChunk(seq, num_tokens))
            if num_drafts:
                speculating.append(chunks[-1])
            budget -= num_tokens
            index += 1
        if speculating:
            budget += self._propose(speculating)

        # Admit waiting sequences, unless this step already had to preempt.
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted
        ):
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq, budget):
                break
            self.block_manager.allocate(seq)  # claims its cached prefix
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            self.waiting.popleft()
            self.block_manager.allocate_slots(seq, num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens

        out.chunks = [c for c in chunks if c.num_tokens == 1] + [
            c for c in chunks if c.num_tokens > 1
        ]
        return out

    def _propose(self, chunks: list[ScheduledChunk]) -> int:
        """Fill the drafts of `chunks` (room reserved for num_tokens - 1 each); the room of
        drafts not proposed goes back. Returns the tokens of budget given back."""
        assert self.proposer is not None
        wanted = [chunk.num_tokens - 1 for chunk in chunks]
        proposals = self.proposer.propose([chunk.seq for chunk in chunks], wanted)
        given_back = 0
        for chunk, drafts, num_wanted in zip(chunks, proposals, wanted, strict=True):
            chunk.draft_token_ids, chunk.draft_probs = drafts.token_ids, drafts.probs
            unused = num_wanted - len(drafts.token_ids)
            if unused:
                chunk.num_tokens -= unused
                seq = chunk.seq
                self.block_manager.truncate(seq, seq.num_computed_tokens + chunk.num_tokens)
                given_back += unused
        return given_back

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Preempt the newest running sequences until `seq` fits. False if `seq` went too."""
        while not self.block_manager.can_allocate_slots(seq, num_tokens):
            victim = self.running.pop()
            self.block_manager.free(victim)
            victim.status = SequenceStatus.WAITING
            self.waiting.appendleft(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True
