"""Placement as pure functions over snapshots of the workers (no I/O, no clock).

- Prefill: score = prefix overlap (how many of the prompt's leading block hashes the worker
  holds) − load_penalty × load. Highest first.
- LoRA: a request with an adapter goes only to workers that serve it; one that has it in a
  slot now scores `affinity` more (llm-d's loraaffinity), so it wins unless it is busier
  by more than affinity / load_penalty requests; elsewhere the worker loads it.
  holds) − load_penalty × load. Highest first. A block held in the worker's second KV tier
  (not its pool) counts `tier_weight` (measures.py: the share of its recompute that loading
  saves) in the score, and as a whole block in `overlap` (it is not computed). With
  --kv-peer-reads, the blocks past its own run that another worker's pool holds and it could
  READ (`peer_runs`, peer_prefix.py) count `peer_weight` each (the share a read saves), but
  not in `overlap`: the hint (peer_prefix.py) says which it reads.
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

from collections.abc import Iterable, Mapping, Sequence, Set
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

    in_tier: Set[int] = frozenset()  # block hashes in its second KV tier
    tier_weight: float = 0.0  # a tier block's worth against a pool block's (0: not loaded)
    peer_weight: float = 0.0  # a block it READs from a peer, against a pool block's (0: never)
    epoch: int = 0  # its process's, from its heartbeat (0: not said)
    transports: tuple[str, ...] = ()  # what it moves KV by, best first (heartbeat)

    @property
    def placeable(self) -> bool:
        return not (self.draining or self.changing)


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    overlap: int  # leading prompt blocks it already holds (pool or second tier)
    score: float
    tier_blocks: int = 0  # of those, held in its second tier
    peer_blocks: int = 0  # past them, blocks it could read from another worker's pool


def held_prefix(block_hashes: Sequence[int], worker: WorkerView) -> tuple[int, int, float]:
    """(blocks, of those in the tier, worth) of the prompt's leading blocks the worker holds
    in its pool or, when loading pays there, its second tier; worth counts a pool block 1.
    Stops at the first block it lacks: a block's hash chains its parent's, so a later hit
    without its parent cannot be reused."""
    blocks = in_tier = 0
    for block_hash in block_hashes:
        if block_hash in worker.cached:
            blocks += 1
        elif worker.tier_weight > 0 and block_hash in worker.in_tier:
            blocks += 1
            in_tier += 1
        else:
            break
    return blocks, in_tier, blocks - in_tier * (1.0 - worker.tier_weight)


def peer_blocks(worker: WorkerView, overlap: int, peer_run: int) -> int:
    """Of a run of `peer_run` leading blocks another worker's pool holds, those past the
    `overlap` the worker holds itself, when reading them pays there (else 0)."""
    return max(0, peer_run - overlap) if worker.peer_weight > 0 else 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def rank_prefill(
    workers: Iterable[WorkerView],
    block_hashes: Sequence[int],
    load_penalty: float,
    adapter: str = "",
    affinity: float = 0.0,
    peer_runs: Mapping[str, int] | None = None,
) -> list[Candidate]:
    """Prefill workers (role "prefill", placeable, serving `adapter`), best first.
    `peer_runs`: by worker id, the leading run it could read from a peer (peer_prefix.py)."""
    ranked = []
    for worker in workers:
        if worker.role != "prefill" or not worker.placeable or not worker.takes(adapter):
            continue
        overlap, in_tier, worth = held_prefix(block_hashes, worker)
        peer = peer_blocks(worker, overlap, (peer_runs or {}).get(worker.worker_id, 0))
        worth += peer * worker.peer_weight
        score = worth - load_penalty * worker.load + worker.affinity(adapter, affinity)
        ranked.append(Candidate(worker.worker_id, overlap, score, in_tier, peer))
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
    peer_runs: Mapping[str, int] | None = None,
) -> list[Candidate]:
    """Decode-capable workers serving `adapter` with room for `num_tokens` (+1 output
    token), best first. `peer_runs`: as rank_prefill's."""
    scored = []
    for worker in workers:
        if worker.role not in DECODE_ROLES or not worker.placeable or not worker.takes(adapter):
            continue
        overlap, in_tier, worth = held_prefix(block_hashes, worker)
        # A tier or peer block is loaded into a free block: only pool blocks save room.
        held = overlap - in_tier
        free_after = worker.free_blocks - (blocks_for(num_tokens + 1, block_size) - held)
        if free_after < 0:
            continue
        peer = peer_blocks(worker, overlap, (peer_runs or {}).get(worker.worker_id, 0))
        worth += peer * worker.peer_weight
        score = worth - load_penalty * worker.load + worker.affinity(adapter, affinity)
        candidate = Candidate(worker.worker_id, overlap, score, in_tier, peer)
        scored.append((-score, -free_after, worker.worker_id, candidate))
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
