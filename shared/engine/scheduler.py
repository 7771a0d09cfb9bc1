"""Continuous batching: which sequences compute how many tokens in the next step, and what
becomes of them after it.

Queues, in order: waiting → running → (finished, or back to waiting when preempted).
Each step spends a token budget (`max_num_batched_tokens`): running sequences first, oldest
first — one token for a decode, a chunk for an unfinished prompt — then waiting sequences
join while budget and `max_num_seqs` allow, a long prompt being cut into chunks across
steps. When blocks run out, the newest running sequence is preempted by recompute: its
blocks are freed and it waits again, keeping its tokens; its prefix may still be cached.
With a second KV tier, the tier blocks of the sequences admitted next are read beside each
step (kv_tier/prefetch.py); one whose reads are still under way (within their deadline)
waits for a later step, unless the step would otherwise be empty.
Speculative decoding: a decoding sequence may reserve room for draft tokens (never by
preempting anyone); once every running sequence is placed, the proposer fills the drafts
of all of them in one call, and what it did not propose goes back before admission.
After the step `update` owns every change of state: computed counts, prefix-cache commits,
appended tokens, accepted drafts, and the end of a sequence. The KV hand-off adds two
states outside the queues: HELD (prefill side, after the first token, until released) and
RESERVED (decode side, blocks held until `start_decode`). `requests` holds every sequence
in any of these states; `finish` is the one place a sequence leaves it.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import TYPE_CHECKING

from shared.engine.block_manager import BlockManager
from shared.engine.errors import OutOfBlocks
from shared.engine.outputs import RequestOutput
from shared.engine.sampler import SampledToken
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.engine.spec_decode import SpecDecodeStats
from shared.engine.stopping import StopRules, append_tokens

if TYPE_CHECKING:
    from shared.engine.spec_decode.proposer import Proposer

LOAD_AHEAD = 4  # waiting sequences whose tier blocks are read beside each step


class BatchScheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        stop_rules: StopRules,
        proposer: Proposer | None = None,  # speculative decoding: draft tokens for decodes
        max_adapters: int = 0,  # LoRA: adapters one step may use (its slots); 0: no limit
    ):
        self.block_manager = block_manager
        self.proposer = proposer
        self.stop_rules = stop_rules
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_adapters = max_adapters
        self.requests: dict[str, Sequence] = {}  # request id -> sequence, any unfinished status
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_held = 0
        self.num_reserved = 0
        self.num_preemptions = 0  # since start
        self.spec_stats = SpecDecodeStats()  # since start: proposed, accepted, verify steps

    # -- requests in and out ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.request_id not in self.requests, "the engine refuses a duplicate id"
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def reserve(self, seq: Sequence) -> int:
        """Decode side: blocks for all of `seq`'s tokens, held (RESERVED) until its KV is in
        and `start_decode`. Returns how many leading blocks its cached prefix already fills.
        OutOfBlocks when they do not fit now."""
        assert seq.request_id not in self.requests, "the engine refuses a duplicate id"
        if not self.block_manager.can_allocate(seq, seq.num_tokens):
            raise OutOfBlocks(f"{seq.request_id}: {self.block_manager.num_free_blocks} blocks free")
        self.block_manager.allocate(seq)
        num_cached = len(seq.block_table)
        self.block_manager.allocate_slots(seq, seq.num_uncomputed_tokens)
        seq.status = SequenceStatus.RESERVED
        self.requests[seq.request_id] = seq
        self.num_reserved += 1
        return num_cached

    def start_decode(self, seq: Sequence, first_token_id: int) -> RequestOutput:
        """A RESERVED sequence's KV is all in: append the prefill worker's first token and
        join the running batch (unless that token already finished it)."""
        assert seq.status == SequenceStatus.RESERVED
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.commit(seq)
        self.num_reserved -= 1
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        output = append_tokens(seq, [SampledToken(first_token_id, None)], self.stop_rules)
        self._settle(seq, output.finish_reason)
        return output

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """The one place a sequence ends (stop, length, abort, release): it leaves the table
        and its queue, and its blocks are freed."""
        del self.requests[seq.request_id]
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.HELD:
            self.num_held -= 1
        else:
            assert seq.status == SequenceStatus.RESERVED, f"{seq.request_id} is {seq.status}"
            self.num_reserved -= 1
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        speculating: list[ScheduledChunk] = []  # decodes with room reserved for drafts
        adapters: set[str] = set()  # LoRA adapters of this step's chunks (max_adapters)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if not self._adapter_fits(seq, adapters):
                index += 1  # its adapter has no slot this step: it waits a step
                continue
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

        # Admit waiting sequences, unless this step already had to preempt to place a running
        # one. (When it preempted them all, it admits: an empty step must mean that nothing
        # can run until a request comes or goes, not that the next step would do better.)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not (out.preempted and chunks)
        ):
            seq = self.waiting[0]
            if chunks and self.block_manager.loading(seq):
                break  # its blocks come from the tier beside this step: it joins the next
            if not self._adapter_fits(seq, adapters) or not self.block_manager.can_allocate(
                seq, budget
            ):
                break
            self.block_manager.allocate(seq)  # claims its cached prefix (pool, then tier)
            room = self.block_manager.room(seq)  # less than planned if a tier load fell short
            num_tokens = min(seq.num_uncomputed_tokens, budget, room)
            self.waiting.popleft()
            self.block_manager.allocate_slots(seq, num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens

        for seq in islice(self.waiting, LOAD_AHEAD):  # admitted next: their tier reads start
            self.block_manager.loading(seq)

        # Decodes first, those of one LoRA adapter side by side (a row's bits never depend
        # on its place; lora/stacked.py takes each adapter's rows together either way)
        decodes = sorted(
            (c for c in chunks if c.num_tokens == 1), key=lambda c: c.seq.params.adapter
        )
        out.chunks = decodes + [c for c in chunks if c.num_tokens > 1]
        return out

    def update(
        self, output: SchedulerOutput, sampled: list[list[SampledToken]]
    ) -> list[RequestOutput]:
        """After the runner: count what each chunk computed (committing the blocks it filled
        to the prefix cache), append the tokens sampled for the chunks that complete, and
        finish or hold the sequences that are done. `sampled`: per completing chunk, in
        order, its token, or a verify chunk's accepted drafts then one more."""
        self.num_preemptions += len(output.preempted)
        per_chunk = iter(sampled)
        outputs = []
        for chunk in output.chunks:
            seq = chunk.seq
            if chunk.draft_token_ids:
                out = self._append_verified(chunk, next(per_chunk))
            else:
                completes = chunk.completes  # read before the computed count moves
                seq.num_computed_tokens += chunk.num_tokens
                self.block_manager.commit(seq)
                if not completes:
                    continue
                out = append_tokens(seq, next(per_chunk), self.stop_rules)
                first_output = seq.num_output_tokens == len(out.new_token_ids)
                if first_output and seq.params.prompt_logprobs is not None:
                    out.prompt_logprobs = list(seq.prompt_logprobs)  # once, with the first token
            self._settle(seq, out.finish_reason)
            outputs.append(out)
        assert next(per_chunk, None) is None, "more sampled tokens than completing chunks"
        return outputs

    def _append_verified(self, chunk: ScheduledChunk, tokens: list[SampledToken]) -> RequestOutput:
        """A verify chunk ran: `tokens` are its accepted drafts then one more. The KV of the last
        real token and of the accepted drafts is kept; the blocks of rejected ones go back."""
        seq, stats = chunk.seq, self.spec_stats
        stats.verify_steps += 1
        stats.proposed += len(chunk.draft_token_ids)
        stats.accepted += len(tokens) - 1
        out = append_tokens(seq, tokens, self.stop_rules)
        if out.finish_reason is None:  # else _settle frees every block, rejected drafts' too
            seq.num_computed_tokens += len(tokens)  # the last real token, the accepted drafts
            self.block_manager.truncate(seq, seq.num_tokens)
            self.block_manager.commit(seq)
            # The draft model's KV past the target's is that of rejected drafts: stale.
            seq.num_draft_computed_tokens = min(
                seq.num_draft_computed_tokens, seq.num_computed_tokens
            )
        return out

    def _settle(self, seq: Sequence, reason: FinishReason | None) -> None:
        """A token was appended to running `seq`: finish it, or hold a prefill's KV."""
        if reason is not None:
            self.finish(seq, reason)
        elif seq.hold_kv:
            self.running.remove(seq)
            seq.status = SequenceStatus.HELD
            self.num_held += 1

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

    def _adapter_fits(self, seq: Sequence, adapters: set[str]) -> bool:
        """Whether `seq` may join a step whose chunks use `adapters` (then it is added): a
        step uses at most `max_adapters` LoRA adapters, the base model not counted."""
        adapter = seq.params.adapter
        if not adapter or not self.max_adapters or adapter in adapters:
            return True
        if len(adapters) >= self.max_adapters:
            return False
        adapters.add(adapter)
        return True

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
