"""Chained block hashes: the prefix-cache identity of a full KV block.

hash(block i) = H(hash(block i-1), its token ids, model id). Two workers that hold a block
with the same hash hold the same KV, so the hash travels between processes and must not
depend on Python's per-process hash seed: it is a 63-bit blake2b digest. A request served
with a LoRA adapter hashes under `cache_key(model id, adapter)`, so its blocks never match
the base model's or another adapter's.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0  # the parent of a sequence's first block


def cache_key(model_id: str, adapter: str) -> str:
    """The `model_id` a request's blocks hash under: the base model's own, or with a LoRA
    adapter its name joined by a byte no name holds (lora/modules.py)."""
    return f"{model_id}\x00{adapter}" if adapter else model_id


def hash_block(parent_hash: int, token_ids: list[int], model_id: str) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent_hash.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    digest.update(model_id.encode())
    return int.from_bytes(digest.digest(), "little") >> 1  # 63 bits: fits msgpack/int64


def hash_full_blocks(
    token_ids: list[int], block_size: int, model_id: str, known: list[int] | None = None
) -> list[int]:
    """Hashes of every full block of `token_ids`, extending the already-known prefix `known`."""
    hashes = list(known or [])
    extend_hashes(hashes, token_ids, block_size, model_id)
    return hashes


def extend_hashes(hashes: list[int], token_ids: list[int], block_size: int, model_id: str) -> None:
    """Append to `hashes` (those of the leading full blocks of `token_ids`) the hashes of the
    full blocks that follow, in place: a block already hashed is never hashed again."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], model_id)
        hashes.append(parent)


def block_hashes(
    token_ids: list[int], block_size: int, model_id: str, num_blocks: int
) -> list[int | None]:
    """One entry per block of a request that fills `num_blocks` blocks with `token_ids`: the
    chained hash of each full block, None for the rest (a partly filled one)."""
    hashes: list[int | None] = [*hash_full_blocks(token_ids, block_size, model_id)[:num_blocks]]
    return hashes + [None] * (num_blocks - len(hashes))
