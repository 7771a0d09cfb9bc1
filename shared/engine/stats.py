"""What the engine reports about itself: counters (`EngineStats`), prefix-cache changes, and
the shape of each step (`step_shape`: prompt tokens and decode rows, what a step's time
is spent on; the worker turns them into rates, services/worker/step_costs.py).

`EngineStats` reads counters kept as things happen (and sums the queued prompts' tokens),
and `KVEventLog` keeps only the net change of each block hash since the last `take`, so a
subscriber that applies `removed` then `stored` to its own set of hashes stays exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.engine.kv_tier.tier_stats import TierStats
from shared.engine.scheduler_output import ScheduledChunk
from shared.engine.sequence import Sequence
from shared.engine.spec_decode import SpecDecodeStats


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What the engine's steps cost, measured by whoever times them (the worker's engine
    thread, services/worker/step_costs.py); 0 is "not measured yet"."""

    prefill_rate: float = 0.0  # prompt tokens computed per second of step time (EWMA)
    decode_step_s: float = 0.0  # seconds per step without prompt tokens (EWMA)
    decode_batch: float = 0.0  # decode rows of those steps (EWMA)
    decode_row_s: float = 0.0  # seconds one more row adds to such a step (fitted; 0: not yet)
    busy_seconds: float = 0.0  # since start: time spent in steps
    stall_s: float = 0.0  # running streams held by prompt work, recent seconds (decayed)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int  # sequences in the running batch
    num_waiting: int  # queued, or preempted and waiting to recompute
    num_held: int  # prefill side: first token out, KV kept until exported and released
    num_reserved: int  # decode side: blocks reserved, the prefill worker's KV awaited
    free_blocks: int  # KV blocks no sequence references (empty or prefix-cached)
    total_blocks: int
    block_size: int  # tokens per block
    usage: float  # fraction of the blocks some sequence references
    prefix_queries: int  # since start: prompt tokens looked up in the prefix cache
    prefix_hits: int  # since start: of those, tokens served from it
    num_preemptions: int  # since start: running sequences sent back to recompute
    spec_decode: SpecDecodeStats  # since start: a copy, so later steps do not change it
    queued_prompt_tokens: int = 0  # prompt tokens of waiting and prefilling sequences not computed
    min_stream_tokens: int = 0  # the fewest max_tokens of a running sequence (0: none runs)
    costs: StepCosts = StepCosts()  # the engine thread's timings (the engine has no clock)
    adapters: tuple[str, ...] = ()  # LoRA adapters it serves (shared/engine/lora/)
    adapters_loaded: tuple[str, ...] = ()  # of those, in a slot now
    adapter_swap_ins: int = 0  # since start: slots filled
    tier: TierStats = field(default_factory=TierStats)  # the second KV tier's counters (kv_tier/)


def queued_prompt_tokens(waiting: Iterable[Sequence], running: Iterable[Sequence]) -> int:
    """Tokens still to prefill: all of a waiting sequence's uncomputed tokens (a preempted
    one recomputes its outputs too), and a running one's until its prompt is computed."""
    queued = sum(seq.num_uncomputed_tokens for seq in waiting)
    return queued + sum(
        seq.num_uncomputed_tokens
        for seq in running
        if seq.num_computed_tokens < seq.num_prompt_tokens
    )


def min_stream_tokens(running: Iterable[Sequence]) -> int:
    """The shortest output a running sequence may have: the stream a stall hurts most."""
    return min((seq.params.max_tokens for seq in running), default=0)


def step_shape(chunks: Iterable[ScheduledChunk]) -> tuple[int, int]:
    """(prompt tokens, decode rows) of a step, counted before it runs. A decode row computes
    one new token (plus its drafts) past the prompt; every other chunk is prefill work."""
    prompt_tokens = decode_rows = 0
    for chunk in chunks:
        new = chunk.num_tokens - len(chunk.draft_token_ids)
        if new == 1 and chunk.seq.num_computed_tokens >= chunk.seq.num_prompt_tokens:
            decode_rows += 1
        else:
            prompt_tokens += chunk.num_tokens
    return prompt_tokens, decode_rows


@dataclass(slots=True)
class KVCacheEvents:
    stored: list[int] = field(default_factory=list)  # hashes now in the prefix cache
    removed: list[int] = field(default_factory=list)  # hashes no longer in it
    tier_stored: list[int] = field(default_factory=list)  # hashes now in the second tier
    tier_removed: list[int] = field(default_factory=list)  # hashes no longer in it

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.tier_stored or self.tier_removed)


class KVEventLog:
    """The prefix cache's net changes since the last `take`.

    Per hash it keeps (was cached at the last take, is cached now); a hash stored and evicted
    within one window is dropped at once, so the log never holds more than twice the number
    of blocks. A hash evicted then stored again is reported as stored (applied after the
    removals, it stays).
    """

    def __init__(self) -> None:
        self._changes: dict[int, tuple[bool, bool]] = {}  # hash -> (cached before, cached now)

    def stored(self, block_hash: int) -> None:
        before, _ = self._changes.get(block_hash, (False, False))
        self._changes[block_hash] = (before, True)

    def removed(self, block_hash: int) -> None:
        before, _ = self._changes.get(block_hash, (True, True))
        if before:
            self._changes[block_hash] = (True, False)
        else:
            del self._changes[block_hash]  # stored in this window: nobody has heard of it

    def take(self) -> KVCacheEvents:
        events = KVCacheEvents()
        for block_hash, (_, now) in self._changes.items():
            if now:
                events.stored.append(block_hash)
            else:  # (False, False) is never kept, so it was cached before
                events.removed.append(block_hash)
        self._changes.clear()
        return events
