"""`WriteAdmission`: which evicted blocks the tier writes — only where evicted blocks return.

Writing a block costs CPU beside the step (a checksum and a file write on the writer
thread), and a block nobody asks for again repays none of it: a workload without reuse
would pay for the tier and get nothing (docs/kv_tier.md). So the tier remembers, as bare
hashes, the blocks it evicted without writing them (the *ghosts*, as many as the tier
could hold), and an admission that misses the pool tells it which blocks it asked for
(`asked`). A block asked for that the tier holds or remembers is a *return*. An evicted
block is written when
- it is a ghost that returned (its second sighting, as CacheLib's reject-first admission
  and SGLang's `write_through_selective`, which writes a node at its second hit), or
- a return was seen fewer than `window` evictions ago: the workload comes back to what it
  evicted (conversations, agents), so every block is written, and even a block's first
  return hits the tier.

The one subtle rule: the ghosts, not the entries, see the returns, so a tier that writes
nothing still learns when writing starts to pay, and a workload that never returns to an
evicted block writes nothing at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

MAX_GHOSTS = 1 << 18  # hashes remembered at most, whatever the tier's size


class WriteAdmission:
    def __init__(self, ghost_capacity: int, window: int) -> None:
        """`ghost_capacity`: blocks the tier could hold; `window`: evictions a return keeps
        every block written for (the tier gives its pool's blocks: the pool turns over once)."""
        self._capacity = max(1, min(ghost_capacity, MAX_GHOSTS))
        self._window = window
        self._ghosts: OrderedDict[int, bool] = OrderedDict()  # hash -> returned; oldest first
        self._evictions = 0  # blocks offered since start
        self._last_return: int | None = None  # `_evictions` at the newest return
        self.unwritten = 0  # since start: evicted blocks not written (none of them returned)

    def asked(self, hashes: list[int], held: Callable[[int], bool]) -> int:
        """An admission missed the pool at `hashes` (in prompt order): count its leading run
        of returns, held by the tier (`held`) or remembered; mark the remembered ones."""
        returned = 0
        for block_hash in hashes:
            if block_hash in self._ghosts:
                self._ghosts[block_hash] = True
            elif not held(block_hash):
                break
            returned += 1
        if returned:
            self._last_return = self._evictions
        return returned

    def admit(self, hashes: list[int]) -> list[bool]:
        """Of evicted blocks not stored yet: which to write. Those not written are
        remembered, the oldest forgotten beyond the capacity."""
        reuse_seen = (
            self._last_return is not None and self._evictions - self._last_return < self._window
        )
        self._evictions += len(hashes)
        written = []
        for block_hash in hashes:
            returned = self._ghosts.pop(block_hash, False)
            written.append(reuse_seen or returned)
            if not written[-1]:
                self._ghosts[block_hash] = False
                self.unwritten += 1
        while len(self._ghosts) > self._capacity:
            self._ghosts.popitem(last=False)
        return written
