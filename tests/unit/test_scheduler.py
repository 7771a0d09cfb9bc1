"""The scheduler driven by a fake model runner: budgets, chunked prefill, preemption, prefix hits.

The fake runner keeps a fake KV cache (the token id written into each slot) and samples the
next token as a function of the tokens it reads back through the block table. A block that is
lost, wrongly shared or overwritten therefore changes the output; preemption must not. What
it samples goes through the real `BatchScheduler.update`, which appends, finishes and frees.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.block_manager import BlockManager
from shared.engine.errors import OutOfBlocks
from shared.engine.outputs import RequestOutput
from shared.engine.sampler import SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import BatchScheduler
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.engine.spec_decode.proposer import Drafts, Proposer
from shared.engine.stopping import StopRules

BS = 4  # block size
VOCAB = 50
EOS = 49  # next_token never reaches it unless a test asks for it
RULES = StopRules(eos_token_ids=(EOS,), max_model_len=1000)


def next_token(context: list[int]) -> int:
    return (7 * sum((i + 1) * t for i, t in enumerate(context)) + len(context)) % (VOCAB - 1)


def reference(prompt: list[int], max_new: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_new:
        tokens.append(next_token(tokens))
    return tokens


class FakeProposer(Proposer):
    """Drafts that follow `next_token`, except one wrong draft at a position that depends on
    the sequence's length (sometimes past the end: all accepted)."""

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[Drafts]:
        proposals = []
        for seq, k in zip(seqs, num_drafts, strict=True):
            tokens = list(seq.token_ids)
            for _ in range(k):
                tokens.append(next_token(tokens))
            drafts = tokens[seq.num_tokens :]
            wrong = seq.num_tokens % (k + 2)
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % (VOCAB - 1)
            proposals.append(Drafts(drafts[: max(1, k - seq.num_tokens % 2)]))
        return proposals


class Harness:
    """A `BatchScheduler` plus a fake runner, checking the scheduler's promises at every step."""

    def __init__(
        self, num_blocks: int, budget: int, max_num_seqs: int, num_drafts: int = 0
    ) -> None:
        self.bm = BlockManager(num_blocks, BS, "tiny")
        proposer = FakeProposer(num_drafts, RULES.max_model_len) if num_drafts else None
        self.scheduler = BatchScheduler(self.bm, budget, max_num_seqs, RULES, proposer)
        self.kv: dict[tuple[int, int], int] = {}  # (block, slot) -> token id written there
        self.finished: dict[str, list[int]] = {}  # request id -> final token ids
        self.reasons: dict[str, FinishReason] = {}
        self.computed: Counter[str] = Counter()  # request id -> tokens computed, recompute too
        self.preemptions = 0
        self.accepted = 0  # draft tokens the fake verification accepted

    def add(self, name: str, prompt: list[int], max_new: int, **params) -> Sequence:
        seq = Sequence(
            name, list(prompt), len(prompt), SamplingParams(max_tokens=max_new, **params), 0
        )
        self.scheduler.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        out = self.scheduler.schedule()
        self._check(out, running, waiting)
        sampled = [self._compute(chunk) for chunk in out.chunks]
        outputs = self.scheduler.update(out, [tokens for tokens in sampled if tokens])
        self._check_outputs(out, sampled, outputs)
        return out

    def _compute(self, chunk: ScheduledChunk) -> list[SampledToken]:
        """Write the chunk's tokens into the fake cache; sample from what reads back. A verify
        chunk keeps its drafts while each is what the context before it gives, then one more."""
        seq, start = chunk.seq, chunk.seq.num_computed_tokens
        written = seq.token_ids[start : start + chunk.num_tokens] + chunk.draft_token_ids
        for pos, token in enumerate(written[: chunk.num_tokens], start=start):
            self.kv[self._slot(seq, pos)] = token
        self.computed[seq.request_id] += chunk.num_tokens
        if not chunk.completes:
            return []
        tokens: list[SampledToken] = []
        for index in range(len(chunk.draft_token_ids) + 1):
            end = seq.num_tokens + index
            context = [self.kv[self._slot(seq, pos)] for pos in range(end)]
            assert context == (seq.token_ids + chunk.draft_token_ids)[:end], "KV of other tokens"
            tokens.append(SampledToken(next_token(context), None))
            if (
                index == len(chunk.draft_token_ids)
                or chunk.draft_token_ids[index] != tokens[-1].token_id
            ):
                break
        self.accepted += len(tokens) - 1
        return tokens

    def run(self, arrivals: dict[int, list[tuple[str, list[int], int]]] | None = None) -> None:
        arrivals = dict(arrivals or {})
        for step in range(10_000):
            for request in arrivals.pop(step, []):
                self.add(*request)
            if not arrivals and not self.scheduler.has_work():
                break
            self.step()
        assert not self.scheduler.has_work(), "no progress after 10,000 steps"
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
        assert not any(self.bm.ref_counts)
        assert not self.scheduler.requests
        assert self.scheduler.num_preemptions == self.preemptions
        assert self.scheduler.spec_stats.accepted == self.accepted

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // BS], pos % BS

    def _check(self, out: SchedulerOutput, running: list[Sequence], waiting: list[Sequence]):
        sched = self.scheduler
        sizes = [chunk.num_tokens for chunk in out.chunks]
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert min(sizes, default=1) >= 1
        assert sizes == sorted(sizes, key=lambda n: n > 1), "decodes come before prefills"
        assert len(sched.running) <= sched.max_num_seqs
        assert len({id(chunk.seq) for chunk in out.chunks}) == len(out.chunks)
        for chunk in out.chunks:
            seq, num_drafts = chunk.seq, len(chunk.draft_token_ids)
            assert seq in sched.running and seq.status == SequenceStatus.RUNNING
            assert seq.num_computed_tokens + chunk.num_tokens - num_drafts <= seq.num_tokens
            assert seq.num_computed_tokens + chunk.num_tokens <= len(seq.block_table) * BS
            assert not num_drafts or chunk.num_tokens == num_drafts + 1
        held = Counter(block for seq in sched.requests.values() for block in seq.block_table)
        assert self.bm.ref_counts == [held[b] for b in range(self.bm.num_blocks)]
        assert all(not seq.block_table for seq in sched.waiting)
        if out.preempted:  # the newest running sequences, now at the front of waiting
            self.preemptions += len(out.preempted)
            k = len(out.preempted)
            kept, queue = running[: len(running) - k], running[len(running) - k :] + waiting
            admitted = sched.running[len(kept) :]
            assert out.preempted == running[::-1][:k]
            assert sched.running[: len(kept)] == kept
            assert not (kept and admitted), "preempted to place a running one, yet admitted"
            assert admitted == queue[: len(admitted)]
            assert list(sched.waiting) == queue[len(admitted) :]
            for seq in out.preempted:
                if seq not in admitted:
                    assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
        else:  # admitted sequences join, oldest waiting first
            admitted = len(sched.running) - len(running)
            assert sched.running == running + waiting[:admitted]

    def _check_outputs(self, out: SchedulerOutput, sampled, outputs: list[RequestOutput]):
        """One output per completing chunk with the tokens sampled for it; a finished sequence
        is gone, a running one keeps blocks for its tokens only (rejected drafts' go back)."""
        completing = [
            (c.seq, tokens) for c, tokens in zip(out.chunks, sampled, strict=True) if tokens
        ]
        assert [o.request_id for o in outputs] == [seq.request_id for seq, _ in completing]
        for (seq, tokens), output in zip(completing, outputs, strict=True):
            assert output.new_token_ids == [t.token_id for t in tokens][: len(output.new_token_ids)]
            assert output.new_token_ids == seq.token_ids[-len(output.new_token_ids) :]
            if output.finish_reason is None:
                assert len(output.new_token_ids) == len(tokens)
                assert self.scheduler.requests[seq.request_id] is seq
                assert seq.num_computed_tokens == seq.num_tokens - 1
                assert len(seq.block_table) <= -(-seq.num_tokens // BS)
                continue
            assert seq.is_finished and seq.block_table == []
            assert seq.request_id not in self.scheduler.requests
            assert seq not in self.scheduler.running
            self.finished[seq.request_id] = list(seq.token_ids)
            self.reasons[seq.request_id] = output.finish_reason


def test_long_prompt_is_chunked_between_decodes() -> None:
    h = Harness(num_blocks=64, budget=8, max_num_seqs=4)
    a = h.add("a", [1, 2, 3], max_new=10)
    assert [(c.seq, c.num_tokens) for c in h.step().chunks] == [(a, 3)]
    b = h.add("b", list(range(20)), max_new=3)
    steps = [[(c.seq, c.num_tokens) for c in h.step().chunks] for _ in range(4)]
    assert steps == [[(a, 1), (b, 7)], [(a, 1), (b, 7)], [(a, 1), (b, 6)], [(a, 1), (b, 1)]]
    h.run()
    assert h.finished == {"a": reference([1, 2, 3], 10), "b": reference(list(range(20)), 3)}


def test_newest_running_sequence_is_preempted_then_recomputed() -> None:
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12]}
    h = Harness(num_blocks=4, budget=16, max_num_seqs=4)
    a, b, c = (h.add(name, prompt, max_new=3) for name, prompt in prompts.items())
    assert [chunk.num_tokens for chunk in h.step().chunks] == [4, 4, 4]  # 3 blocks, 1 free
    out = h.step()  # a takes the free block; b needs one too, so c goes
    assert out.preempted == [c]
    assert [(chunk.seq, chunk.num_tokens) for chunk in out.chunks] == [(a, 1), (b, 1)]
    assert list(h.scheduler.waiting) == [c] and c.block_table == []
    h.run()
    assert h.finished == {name: reference(prompt, 3) for name, prompt in prompts.items()}
    assert h.computed["c"] > 4 + 2  # c's first prefill and its sampled token were recomputed


def test_verify_chunks_keep_accepted_drafts_and_give_back_rejected_slots() -> None:
    h = Harness(num_blocks=16, budget=16, max_num_seqs=2, num_drafts=3)
    a = h.add("a", [1, 2, 3], max_new=12)
    h.step()  # prefill; the first token
    steps = [h.step() for _ in range(3)]
    verify = [chunk for out in steps for chunk in out.chunks if chunk.draft_token_ids]
    assert verify, "decodes were meant to get drafts"
    stats = h.scheduler.spec_stats
    assert stats.verify_steps == len(verify)
    assert stats.proposed == sum(len(chunk.draft_token_ids) for chunk in verify)
    assert 0 < stats.accepted == h.accepted < stats.proposed  # FakeProposer errs at times
    assert len(a.block_table) == -(-a.num_tokens // BS)
    h.run()
    assert h.finished == {"a": reference([1, 2, 3], 12)}
    assert h.reasons == {"a": FinishReason.LENGTH}


def test_finish_reasons_stop_eos_length_and_context() -> None:
    prompt = [1, 2, 3]
    free = reference(prompt, 8)[len(prompt) :]
    h = Harness(num_blocks=32, budget=32, max_num_seqs=8)
    h.add("stop", prompt, max_new=8, stop_token_ids=(free[2],))
    h.add("length", prompt, max_new=4)
    h.run()
    eos = Harness(num_blocks=32, budget=32, max_num_seqs=8)
    eos.scheduler.stop_rules = StopRules(eos_token_ids=(free[1],), max_model_len=1000)
    eos.add("eos", prompt, max_new=8)
    eos.add("ignore_eos", prompt, max_new=8, ignore_eos=True)
    eos.run()
    context = Harness(num_blocks=32, budget=32, max_num_seqs=8)
    context.scheduler.stop_rules = StopRules(eos_token_ids=(), max_model_len=len(prompt) + 5)
    context.add("context", prompt, max_new=8)
    context.run()
    assert h.reasons == {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
    assert h.finished == {"stop": reference(prompt, 3), "length": reference(prompt, 4)}
    assert eos.reasons == {"eos": FinishReason.STOP, "ignore_eos": FinishReason.LENGTH}
    assert eos.finished == {"eos": reference(prompt, 2), "ignore_eos": reference(prompt, 8)}
    assert context.reasons == {"context": FinishReason.LENGTH}
    assert context.finished == {"context": reference(prompt, 5)}


def test_held_and_reserved_sequences_keep_their_blocks_outside_the_batch() -> None:
    h = Harness(num_blocks=8, budget=16, max_num_seqs=4)
    prefill = h.add("prefill", [1, 2, 3, 4, 5, 6], max_new=5)
    prefill.hold_kv = True
    while prefill.status != SequenceStatus.HELD:
        h.step()
    assert prefill.num_output_tokens == 1 and len(prefill.block_table) == 2
    assert prefill not in h.scheduler.running and h.scheduler.num_held == 1
    assert not h.scheduler.has_work()
    held_blocks = list(prefill.block_table)

    tokens = reference([7, 8, 9, 10, 11], 1)  # the prompt and the prefill worker's token
    decode = Sequence("decode", list(tokens), 5, SamplingParams(max_tokens=4), 0)
    assert h.scheduler.reserve(decode) == 0
    assert decode.status == SequenceStatus.RESERVED and h.scheduler.num_reserved == 1
    assert len(decode.block_table) == 2 and not set(decode.block_table) & set(held_blocks)
    for pos, token in enumerate(tokens):  # the "imported" KV
        h.kv[h._slot(decode, pos)] = token
    greedy = Sequence("big", list(range(20)), 20, SamplingParams(max_tokens=4), 0)
    with pytest.raises(OutOfBlocks):
        h.scheduler.reserve(greedy)  # 5 blocks, 4 free
    assert "big" not in h.scheduler.requests and h.bm.num_free_blocks == 4

    first = h.scheduler.start_decode(decode, next_token(tokens))
    assert first.new_token_ids == [next_token(tokens)] and first.finish_reason is None
    assert decode.token_ids == reference([7, 8, 9, 10, 11], 2)
    assert decode in h.scheduler.running and h.scheduler.num_reserved == 0
    h.scheduler.finish(prefill, FinishReason.ABORT)  # released after export
    assert h.scheduler.num_held == 0 and "prefill" not in h.scheduler.requests
    h.run()
    assert h.finished == {"decode": reference([7, 8, 9, 10, 11], 4)}


def test_a_step_that_preempts_every_running_sequence_admits_at_once() -> None:
    """Blocks held outside the batch (a reservation): the only running sequence outgrows the
    rest and goes; the same step re-admits its first chunk rather than scheduling nothing."""
    h = Harness(num_blocks=5, budget=4, max_num_seqs=2)
    h.bm.enable_prefix_caching = False
    reserved = Sequence("r", [1] * 8, 8, SamplingParams(max_tokens=1), 0)
    h.scheduler.reserve(reserved)  # 2 of the 5 blocks
    a = h.add("a", list(range(8)), max_new=8)
    out = h.step()
    while not out.preempted:
        out = h.step()
    assert out.preempted == [a] and [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 4)]
    h.scheduler.finish(reserved, FinishReason.ABORT)
    h.run()
    assert h.finished == {"a": reference(list(range(8)), 8)}


def test_identical_prompt_computes_fewer_tokens() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    h = Harness(num_blocks=16, budget=32, max_num_seqs=4)
    h.add("first", prompt, max_new=3)
    h.run()
    second = h.add("second", prompt, max_new=3)
    h.run()
    assert second.num_cached_tokens == 8  # the full blocks of prompt[:-1]
    assert h.bm.prefix_hits == 8
    assert h.computed["second"] == h.computed["first"] - 8 == len(prompt) + 2 - 8
    assert h.finished["second"] == h.finished["first"] == reference(prompt, 3)


def test_failed_admission_counts_no_prefix_hits() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # 2 full blocks of prompt[:-1] get cached
    h = Harness(num_blocks=4, budget=32, max_num_seqs=4)
    h.add("first", prompt, max_new=1)
    h.run()
    h.add("other", [7, 7, 7, 7, 7], max_new=3)  # holds the 2 other blocks for 3 steps
    h.add("again", prompt, max_new=1)  # hits 2 blocks, needs a 3rd: waits until "other" ends
    h.run()
    assert h.finished["again"] == reference(prompt, 1)
    assert h.bm.prefix_hits == 8, "each refused admission counted its prefix hits again"
    assert h.bm.prefix_queries == 2 * len(prompt) + 5


requests = st.lists(
    st.tuples(
        st.integers(0, 4),  # arrival step
        st.integers(0, 12),  # tokens shared with the previous request's prompt
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
        st.integers(1, 6),  # max new tokens
    ),
    min_size=2,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(
    requests=requests,
    extra_blocks=st.integers(0, 2),
    budget=st.integers(1, 12),
    max_num_seqs=st.integers(1, 4),
    num_drafts=st.integers(1, 3),
)
def test_any_workload_finishes_with_reference_tokens(
    requests: list[tuple[int, int, list[int], int]],
    extra_blocks: int,
    budget: int,
    max_num_seqs: int,
    num_drafts: int,
) -> None:
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    expected, prompt = {}, []
    for index, (arrival, shared, suffix, max_new) in enumerate(requests):
        prompt = prompt[:shared] + suffix
        arrivals.setdefault(arrival, []).append((f"r{index}", prompt, max_new))
        expected[f"r{index}"] = reference(prompt, max_new)
    needed = max(-(-len(tokens) // BS) for tokens in expected.values())
    tight = Harness(needed + extra_blocks, budget, max_num_seqs)
    tight.run(arrivals)
    plenty = Harness(len(requests) * needed, budget, max_num_seqs)
    plenty.run(arrivals)
    assert plenty.preemptions == 0
    speculating = Harness(needed + extra_blocks, budget, max_num_seqs, num_drafts)
    speculating.run(arrivals)
    assert tight.finished == plenty.finished == speculating.finished == expected
