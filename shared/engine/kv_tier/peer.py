"""Prefix blocks read from another worker's pool into this one's (docs/kv_tier.md), as the
engine's thread sees them: `take_for_peer` plans a read and takes the blocks it fills, the
worker's transport READs into them, and `BlockManager.adopt` caches them (or `unpin` gives
them back when the READ failed). The holder's side is `BlockManager.pin_cached` / `unpin`.

The one subtle rule: a read fills only blocks this pool lacks, from the first one it lacks,
and only when the pool could hold the whole prompt besides — so a prompt admitted after the
read finds the blocks as ordinary prefix-cache hits, and a read that is lost or refused
leaves the pool as it was (the prompt is then computed, as without a hint).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.block_hash import cache_key, hash_full_blocks
from shared.engine.block_manager import BlockManager


@dataclass(frozen=True, slots=True)
class PeerTake:
    first_block: int  # index in the prompt of block_hashes[0]
    block_ids: list[int]  # fresh blocks of this pool, one per hash, for the READ to fill
    block_hashes: list[int]  # the prompt's chained hashes of the blocks to read


def take_for_peer(
    blocks: BlockManager, token_ids: list[int], adapter: str, end_block: int
) -> PeerTake | None:
    """Take fresh blocks for the prompt's blocks [first lacking, `end_block`) (none when the
    pool lacks none of them); None when it could not hold the whole prompt besides them."""
    if not blocks.enable_prefix_caching:
        return None  # nowhere to keep them
    key = cache_key(blocks.model_id, adapter)
    # As a lookup does (BlockManager._lookup): never the last token's block.
    hashes = hash_full_blocks(token_ids[:-1], blocks.block_size, key)[:end_block]
    first = next((i for i, h in enumerate(hashes) if h not in blocks.cached), len(hashes))
    wanted = hashes[first:]
    if not wanted:
        return PeerTake(first, [], [])
    held = blocks.pin_cached(hashes[:first])  # taking must not evict the prefix it extends
    try:
        if blocks.blocks_for(len(token_ids) + 1) - len(held) > blocks.num_free_blocks:
            return None  # the prompt's other blocks would not fit beside them
        return PeerTake(first, blocks.take_blocks(len(wanted)), wanted)
    finally:
        blocks.unpin(held)


def adopt_read(blocks: BlockManager, take: PeerTake, num_read: int) -> None:
    """The READ filled the first `num_read` blocks of `take`: cache them, free the rest."""
    blocks.adopt(take.block_ids[:num_read], take.block_hashes[:num_read])
    blocks.unpin(take.block_ids[num_read:])
