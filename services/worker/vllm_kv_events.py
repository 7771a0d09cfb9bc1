"""vLLM's KV cache events (BlockStored, BlockRemoved, AllBlocksCleared) as our block hashes.

vLLM hashes its blocks its own way; the scheduler indexes the hashes of
shared/engine/block_hash.py. A `BlockStored` carries the token ids of the blocks it stores
and the vLLM hash of the block before them, so each stored block is re-hashed our way,
chained from its parent's hash *ours* (looked up in the map from vLLM's hashes to ours
this translator keeps), and the map turns each `BlockRemoved` back into our hash.

The one subtle rule: vLLM may cache several blocks with one hash (and one of our hashes may
stand for several vLLM hashes), each stored and removed on its own, so our hash is reported
stored when its first vLLM block is cached and removed when its last one goes.

Blocks we cannot hash our way are skipped, and so are their children (their parent is then
unknown): a block size other than the worker's (vLLM's partial-block entries of hybrid
models), extra hash keys (LoRA, multimodal, cache salt: the scheduler's hashes have none),
a medium other than the engine's own cache (offloading tiers), token ids not a whole number
of blocks. Skipping only hides a cached prefix from the scheduler; it never claims one.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

from shared.engine.block_hash import ROOT_HASH, hash_block
from shared.engine.stats import KVCacheEvents, KVEventLog

log = logging.getLogger(__name__)
VllmKey = tuple[int, bytes | int]  # (KV cache group, vLLM's block hash)


class VllmKVEventTranslator:
    def __init__(self, block_size: int, model_id: str) -> None:
        self.block_size = block_size
        self.model_id = model_id
        self.num_skipped = 0  # blocks vLLM stored that we could not hash our way
        self._ours: dict[VllmKey, int] = {}  # a cached vLLM block hash -> our hash
        self._copies: Counter[VllmKey] = Counter()  # cached vLLM blocks with that hash
        self._held: Counter[int] = Counter()  # our hash -> vLLM hashes standing for it
        self._log = KVEventLog()

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        """Everything is gone from vLLM's cache, or we lost track of it (missed events)."""
        for our_hash in self._held:
            self._log.removed(our_hash)
        self._ours.clear()
        self._copies.clear()
        self._held.clear()

    def take(self) -> KVCacheEvents:
        """The net changes of our hashes since the last take."""
        return self._log.take()

    def _stored(self, event: BlockStored) -> None:
        group = event.group_idx or 0
        size = self.block_size
        whole = len(event.token_ids) == len(event.block_hashes) * size
        if not (whole and self._hashable(event)):
            self._skip(event, len(event.block_hashes))
            return
        parent = self._parent(group, event.parent_block_hash)
        extra_keys = event.extra_keys or [None] * len(event.block_hashes)
        for i, (vllm_hash, extra) in enumerate(zip(event.block_hashes, extra_keys, strict=True)):
            if parent is None or extra is not None:
                self._skip(event, len(event.block_hashes) - i)
                return
            parent = hash_block(parent, event.token_ids[i * size : (i + 1) * size], self.model_id)
            self._add((group, vllm_hash), parent)

    def _hashable(self, event: BlockStored) -> bool:
        return event.block_size == self.block_size and event.medium in (None, MEDIUM_GPU)

    def _parent(self, group: int, parent_hash: bytes | int | None) -> int | None:
        if parent_hash is None:
            return ROOT_HASH
        return self._ours.get((group, parent_hash))

    def _add(self, key: VllmKey, our_hash: int) -> None:
        self._copies[key] += 1
        if self._copies[key] > 1:
            return
        self._ours[key] = our_hash
        self._held[our_hash] += 1
        if self._held[our_hash] == 1:
            self._log.stored(our_hash)

    def _removed(self, event: BlockRemoved) -> None:
        if event.medium not in (None, MEDIUM_GPU):
            return
        group = event.group_idx or 0
        for vllm_hash in event.block_hashes:
            key = (group, vllm_hash)
            if key not in self._ours:
                continue  # one we skipped (or never heard stored)
            self._copies[key] -= 1
            if self._copies[key]:
                continue
            del self._copies[key]
            our_hash = self._ours.pop(key)
            self._held[our_hash] -= 1
            if not self._held[our_hash]:
                del self._held[our_hash]
                self._log.removed(our_hash)

    def _skip(self, event: BlockStored, num_blocks: int) -> None:
        if not self.num_skipped:
            log.info(
                "vLLM cached blocks the scheduler cannot index (block size %d, medium %s): "
                "they are not reported",
                event.block_size,
                event.medium,
            )
        self.num_skipped += num_blocks
