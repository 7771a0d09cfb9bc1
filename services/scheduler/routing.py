"""Placement as pure functions over snapshots of the workers (no I/O, no clock).

- Prefill: score = prefix overlap (how many of the prompt's leading block hashes the worker
  holds) − load_penalty × load. Highest first.
- LoRA: a request with an adapter goes only to workers that serve it; one that has it in a
  slot now scores `affinity` more (llm-d's loraaffinity), so it wins unless it is busier
  by more than affinity / load_penalty requests; elsewhere the worker loads it.
- Neither places on a worker draining or changing its role (mid-change: its heartbeat names
  the next role), whatever its role is now.
- Decode: among workers of role decode|both, with enough free blocks for the
  prompt's uncached part plus one block of output: the same score, then more free blocks
  left after placement, so an idle pool fills its emptiest worker first.
- Conditional disaggregation: which path a request takes on its decode worker is chosen
  by cost (path_cost.py); `prefills_locally` is the fixed rule that choice started from.
Ties break on the worker id, so a placement is reproducible.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field

from services.scheduler.measures import WorkerCosts

DECODE_ROLES = ("decode", "both")


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What routing needs of one worker, as the registry last heard it."""

    worker_id: str
    role: str
    draining: bool
    free_blocks: int
    load: int  # running + waiting requests, plus those placed since its last heartbeat
    cached: Set[int]  # block hashes in its prefix cache
    costs: WorkerCosts = field(default_factory=WorkerCosts)  # measured (path choice)
    changing: bool = False  # mid-change of its role: nothing is placed on it
    adapters: frozenset[str] = frozenset()  # LoRA adapters it serves
    adapters_loaded: frozenset[str] = frozenset()  # of those, in a slot now

    def takes(self, adapter: str) -> bool:
        """Serves requests of `adapter` ("": the base model: every worker does)."""
        return not adapter or adapter in self.adapters

    def affinity(self, adapter: str, bonus: float) -> float:
        """`bonus` when `adapter` is in one of its slots, else 0."""
        return bonus if adapter and adapter in self.adapters_loaded else 0.0

    @property
    def placeable(self) -> bool:
        return not (self.draining or self.changing)


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    overlap: int  # leading prompt blocks it already holds
    score: float


def prefix_overlap(block_hashes: Sequence[int], cached: Set[int]) -> int:
    """How many of the prompt's leading full blocks are in `cached` (stops at the first miss:
    a block's hash chains its parent's, so a later hit without its parent cannot be reused)."""
    count = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def rank_prefill(
    workers: Iterable[WorkerView],
    block_hashes: Sequence[int],
    load_penalty: float,
    adapter: str = "",
    affinity: float = 0.0,
) -> list[Candidate]:
    """Prefill workers (role "prefill", placeable, serving `adapter`), best first."""
    ranked = []
    for worker in workers:
        if worker.role != "prefill" or not worker.placeable or not worker.takes(adapter):
            continue
        overlap = prefix_overlap(block_hashes, worker.cached)
        score = overlap - load_penalty * worker.load + worker.affinity(adapter, affinity)
        ranked.append(Candidate(worker.worker_id, overlap, score))
    ranked.sort(key=lambda c: (-c.score, c.worker_id))
    return ranked


def rank_decode(
    workers: Iterable[WorkerView],
    block_hashes: Sequence[int],
    num_tokens: int,
    block_size: int,
    load_penalty: float,
    adapter: str = "",
    affinity: float = 0.0,
) -> list[Candidate]:
    """Decode-capable workers serving `adapter` with room for `num_tokens` (+1 output
    token), best first."""
    scored = []
    for worker in workers:
        if worker.role not in DECODE_ROLES or not worker.placeable or not worker.takes(adapter):
            continue
        overlap = prefix_overlap(block_hashes, worker.cached)
        free_after = worker.free_blocks - (blocks_for(num_tokens + 1, block_size) - overlap)
        if free_after < 0:
            continue
        score = overlap - load_penalty * worker.load + worker.affinity(adapter, affinity)
        scored.append(
            (-score, -free_after, worker.worker_id, Candidate(worker.worker_id, overlap, score))
        )
    scored.sort(key=lambda entry: entry[:3])
    return [entry[3] for entry in scored]


def prefills_locally(
    num_tokens: int,
    decode_overlap: int,
    block_size: int,
    local_prefill_tokens: int,
    have_prefill_workers: bool,
) -> bool:
    """Decode-only path: no prefill worker to use, or few tokens uncached on the decode worker."""
    uncached = num_tokens - decode_overlap * block_size
    return not have_prefill_workers or uncached <= local_prefill_tokens
