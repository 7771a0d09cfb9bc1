"""The scheduler driven by a fake model runner: budgets, chunked prefill, preemption, prefix hits.

The fake runner keeps a fake KV cache (the token id written into each slot) and samples the
next token as a function of the tokens it reads back through the block table. A block that is
lost, wrongly shared or overwritten therefore changes the output; preemption must not.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.block_manager import BlockManager
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerOutput
from shared.engine.sequence import Sequence, SequenceStatus

BS = 4  # block size
VOCAB = 50


def next_token(context: list[int]) -> int:
    return (7 * sum((i + 1) * t for i, t in enumerate(context)) + len(context)) % VOCAB


def reference(prompt: list[int], max_new: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_new:
        tokens.append(next_token(tokens))
    return tokens


class Harness:
    """A `Scheduler` plus a fake runner, checking the scheduler's promises at every step."""

    def __init__(self, num_blocks: int, budget: int, max_num_seqs: int) -> None:
        self.bm = BlockManager(num_blocks, BS, "tiny")
        self.scheduler = Scheduler(self.bm, budget, max_num_seqs)
        self.kv: dict[tuple[int, int], int] = {}  # (block, slot) -> token id written there
        self.max_len: dict[str, int] = {}
        self.finished: dict[str, list[int]] = {}  # request id -> final token ids
        self.computed: Counter[str] = Counter()  # request id -> tokens computed, recompute too
        self.preemptions = 0

    def add(self, name: str, prompt: list[int], max_new: int) -> Sequence:
        seq = Sequence(name, list(prompt), len(prompt), SamplingParams(max_tokens=max_new), 0)
        self.max_len[name] = len(prompt) + max_new
        self.scheduler.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        out = self.scheduler.schedule()
        self._check(out, running, waiting)
        for chunk in out.chunks:
            seq, completes = chunk.seq, chunk.completes
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_tokens):
                self.kv[self._slot(seq, pos)] = seq.token_ids[pos]
            seq.num_computed_tokens += chunk.num_tokens
            self.computed[seq.request_id] += chunk.num_tokens
            self.bm.commit(seq)
            if completes:
                context = [self.kv[self._slot(seq, pos)] for pos in range(seq.num_tokens)]
                assert context == seq.token_ids, f"{seq.request_id} reads KV of other tokens"
                seq.token_ids.append(next_token(context))
                if seq.num_tokens == self.max_len[seq.request_id]:
                    self.scheduler.remove(seq)
                    self.bm.free(seq)
                    self.finished[seq.request_id] = list(seq.token_ids)
        return out

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
            seq = chunk.seq
            assert seq in sched.running and seq.status == SequenceStatus.RUNNING
            assert seq.num_computed_tokens + chunk.num_tokens <= seq.num_tokens
            assert seq.num_computed_tokens + chunk.num_tokens <= len(seq.block_table) * BS
        held = Counter(block for seq in sched.running for block in seq.block_table)
        assert self.bm.ref_counts == [held[b] for b in range(self.bm.num_blocks)]
        assert all(not seq.block_table for seq in sched.waiting)
        if out.preempted:  # the newest running sequences, now at the front of waiting
            self.preemptions += len(out.preempted)
            k = len(out.preempted)
            assert out.preempted == running[::-1][:k]
            assert sched.running == running[:-k]
            assert list(sched.waiting) == running[-k:] + waiting
            for seq in out.preempted:
                assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
        else:  # admitted sequences join, oldest waiting first
            admitted = len(sched.running) - len(running)
            assert sched.running == running + waiting[:admitted]


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
)
def test_any_workload_finishes_with_reference_tokens(
    requests: list[tuple[int, int, list[int], int]],
    extra_blocks: int,
    budget: int,
    max_num_seqs: int,
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
    assert tight.finished == plenty.finished == expected
