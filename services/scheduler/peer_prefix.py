"""Which other worker to read a prompt's prefix from: a pure function over the registry's
snapshots (`--kv-peer-reads`, docs/kv_tier.md).

The worker that computes a prompt holds `overlap` of its leading blocks (pool or tier). When
another worker of the same model holds a longer leading run in its pool — the KV events
say so — and both move KV by the same one-sided transport (a READ needs one: nixl, or the
fake one in tests), the computing worker is told (`PeerPrefix` on its task) to read blocks
[overlap, that run's end) from it rather than compute them; it decides by measured cost
whether to (services/worker/peer_reads.py). The longest run wins; ties go to the worker id;
the next longest (up to `MAX_HOLDERS` in all) ride along as `others`, tried in turn when a
read fails. `peer_runs` gives placement, for every worker, the longest run it could read
this way, which the prefix score weighs by the worker's measured read cost (routing.py).

The one subtle rule: the last prompt token's block is never counted (the engine computes at
least one token for its logits, so it never reuses that block), as `predicted_tokens` caps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from services.scheduler.routing import Candidate, WorkerView
from shared.prefix_messages import MAX_HOLDERS, PeerHolder, PeerPrefix

ONE_SIDED_NEVER = ("nats",)  # transports that cannot READ from a peer's pool


def pool_run(block_hashes: Sequence[int], worker: WorkerView) -> int:
    """How many of the prompt's leading blocks `worker`'s pool holds."""
    count = 0
    for block_hash in block_hashes:
        if block_hash not in worker.cached:
            break
        count += 1
    return count


def usable_blocks(block_hashes: Sequence[int], num_tokens: int, block_size: int) -> Sequence[int]:
    """The prompt's blocks a hit may cover: never the last token's (see the subtle rule)."""
    return block_hashes[: max(0, (num_tokens - 1) // block_size)]


def reads_from(computer: WorkerView, holder: WorkerView) -> bool:
    """Can `computer` READ from `holder`'s pool (by its best one-sided transport)?"""
    one_sided = [t for t in computer.transports if t not in ONE_SIDED_NEVER]
    return (
        bool(one_sided)
        and holder.worker_id != computer.worker_id
        and not holder.draining
        and one_sided[0] in holder.transports
    )


def peer_runs(workers: Sequence[WorkerView], usable: Sequence[int]) -> dict[str, int]:
    """For each worker, the longest leading run of `usable` (usable_blocks) that another
    worker's pool holds and it could READ (0: none)."""
    runs = {worker.worker_id: pool_run(usable, worker) for worker in workers}
    return {
        computer.worker_id: max(
            (runs[h.worker_id] for h in workers if reads_from(computer, h)), default=0
        )
        for computer in workers
    }


def peer_prefix(
    workers: Iterable[WorkerView],
    block_hashes: Sequence[int],
    computer_id: str,
    overlap: int,
    num_tokens: int,
    block_size: int,
) -> PeerPrefix | None:
    """The hint for worker `computer_id`, which holds `overlap` leading blocks; None: no
    other worker holds more, or the two share no one-sided transport."""
    workers = list(workers)
    computer = next((w for w in workers if w.worker_id == computer_id), None)
    if computer is None:
        return None
    usable = usable_blocks(block_hashes, num_tokens, block_size)
    runs = [(pool_run(usable, w), w) for w in workers if reads_from(computer, w)]
    longer = sorted(
        ((run, w) for run, w in runs if run > overlap), key=lambda e: (-e[0], e[1].worker_id)
    )[:MAX_HOLDERS]
    if not longer:
        return None
    (run, holder), *others = longer
    more = [PeerHolder(w.worker_id, w.epoch, n - overlap) for n, w in others]
    return PeerPrefix(holder.worker_id, holder.epoch, overlap, run - overlap, more)


def with_peer(computer: Candidate, hint: PeerPrefix | None) -> Candidate:
    """`computer` as the hit it is predicted to get: its own blocks, and those it reads."""
    if hint is None:
        return computer
    return replace(computer, overlap=computer.overlap + hint.num_blocks)
