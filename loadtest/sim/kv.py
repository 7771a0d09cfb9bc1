"""A modelled worker's KV pool: blocks held by its requests, and a prefix cache of block
hashes in the room they leave.

- A request holds whole blocks from admission (or reservation) to its end: its prompt's and
  its reply's, so a running request never needs a block it cannot get (the engine preempts
  instead; the simulator leaves preemption out).
- A prompt's full blocks enter the prefix cache when computed (or received); the cache lives
  in the free blocks, least recently used evicted first when holding needs the room.
- Free blocks, as a heartbeat reports them, are those no request holds (cached ones count:
  they are evictable, as in the engine's block manager).

The one subtle rule: every hash stored or evicted is reported once, in order, as a KV event
(`drain_events`), so the scheduler's registry sees the cache the way it sees a real worker's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KVPool:
    def __init__(self, total_blocks: int) -> None:
        self.total = total_blocks
        self.held = 0
        self._cache: OrderedDict[int, None] = OrderedDict()  # hash → (), oldest use first
        self._stored: list[int] = []
        self._removed: list[int] = []

    @property
    def free(self) -> int:
        return self.total - self.held

    def can_hold(self, num_blocks: int) -> bool:
        return self.held + num_blocks <= self.total

    def hold(self, num_blocks: int) -> None:
        assert self.can_hold(num_blocks), "hold() without can_hold()"
        self.held += num_blocks
        self._evict()

    def release(self, num_blocks: int) -> None:
        self.held -= num_blocks
        assert self.held >= 0, "released more blocks than held"

    def overlap(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` in the cache (each hit becomes the newest use)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._cache:
                break
            self._cache.move_to_end(block_hash)
            count += 1
        return count

    def store(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            if block_hash in self._cache:
                self._cache.move_to_end(block_hash)
            else:
                self._cache[block_hash] = None
                self._stored.append(block_hash)
        self._evict()

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(stored, removed) since the last call."""
        events = (self._stored, self._removed)
        self._stored, self._removed = [], []
        return events

    def _evict(self) -> None:
        while len(self._cache) > self.free:
            block_hash, _ = self._cache.popitem(last=False)
            self._removed.append(block_hash)
