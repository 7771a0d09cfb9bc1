"""`TierPrefetch`: the loader thread that reads tier entries for the requests admitted next
while the engine's step runs, so that their blocks are in host memory, read and checked,
when they are admitted (docs/kv_tier.md).

The engine thread `start`s reads (a bounded queue: what does not fit is read at admission,
as without a loader), asks whether a run is still `waiting`, and `take`s each block's
result as it loads. A read has a deadline: past it the block is `LATE`, and the engine
computes it rather than wait on. The one subtle rule: every result is taken at most once,
and at most `depth` results are kept; a result nobody takes (its request aborted) is
dropped oldest first, so memory stays bounded whatever the requests do.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from enum import IntEnum

DEPTH = 128  # blocks queued or read and not yet taken, at most

Result = memoryview | Exception  # the entry's checked payload, or why it was refused


class FetchState(IntEnum):
    NONE = 0  # never asked (or taken already): read it at admission
    WAITING = 1  # queued or being read, its deadline not passed
    LATE = 2  # its deadline passed before it was read: compute it
    DONE = 3  # read: `take` returns it


class TierPrefetch:
    def __init__(self, read: Callable[[int], Result | None], depth: int = DEPTH) -> None:
        """`read(hash)`: the entry's payload, None when not stored, or the exception that
        refused it; called on the loader thread."""
        self._read = read
        self._depth = depth
        self._lock = threading.Lock()
        self._asked: dict[int, float] = {}  # hash → deadline (time.monotonic), not yet read
        self._done: OrderedDict[int, Result | None] = OrderedDict()  # oldest first
        # Unbounded, yet never long: what it holds beyond `depth` are hashes given up on,
        # which the loader skips at once.
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-tier-loader", daemon=True)
        self._thread.start()

    def start(self, hashes: list[int], deadline: float) -> None:
        """Queue reads of `hashes` not asked yet, until the queue is full."""
        with self._lock:
            for block_hash in hashes:
                if block_hash in self._asked or block_hash in self._done:
                    continue
                if len(self._asked) + len(self._done) >= self._depth:
                    return
                self._asked[block_hash] = deadline
                self._queue.put(block_hash)

    def waiting(self, hashes: list[int]) -> bool:
        """Is any of `hashes` queued or being read, within its deadline?"""
        now = time.monotonic()
        with self._lock:
            return any(self._asked.get(h, 0.0) > now for h in hashes)

    def take(self, block_hash: int) -> tuple[FetchState, Result | None]:
        """The block's state, and its result when DONE; either way it is forgotten (a read
        still under way is dropped when it ends)."""
        with self._lock:
            if block_hash in self._done:
                return FetchState.DONE, self._done.pop(block_hash)
            deadline = self._asked.pop(block_hash, None)
        if deadline is None:
            return FetchState.NONE, None
        return (FetchState.WAITING if deadline > time.monotonic() else FetchState.LATE), None

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (block_hash := self._queue.get()) is not None:
            with self._lock:
                wanted = block_hash in self._asked
            if not wanted:
                continue  # taken (given up on) before its turn
            result = self._read(block_hash)
            with self._lock:
                if self._asked.pop(block_hash, None) is None:
                    continue  # given up on while it was read
                self._done[block_hash] = result
                while len(self._done) > self._depth:
                    self._done.popitem(last=False)
