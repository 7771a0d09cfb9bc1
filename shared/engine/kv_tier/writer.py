"""`TierWriter`: the thread that writes evicted blocks to the tier, off the engine's step.

The engine thread `offer`s the blocks one call evicted, copied out of the pool together in
one tensor, and goes on; the writer copies each block out of it into one buffer, then
checksums and stores it as its own entry: three calls that each let go of the GIL, and no
torch call (which would start a second OpenMP team beside the engine's). It runs at the
engine's CPU priority: a lower one starved it on a loaded host while it held the GIL, and
the engine's thread waited for it (docs/kv_tier.md). The queue is bounded in blocks: the
engine asks for `room` before copying, and an offer beyond it is refused and counted
(`dropped`), never waited for. The one subtle rule: the first write that fails (a full
disk, a removed directory) stops every later one for good and is logged once (`stopped`);
the blocks are then recomputed as they would be without a tier.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np
import torch

from shared.engine.kv_tier.entry import TierLayout, entry_parts
from shared.engine.kv_tier.store import TierStore

log = logging.getLogger(__name__)

QUEUE_DEPTH = 256  # blocks waiting to be written, at most

Batch = tuple[list[int], np.ndarray]  # hashes, and their blocks' bytes: [L, n, bytes a layer]


class TierWriter:
    def __init__(self, store: TierStore, layout: TierLayout, depth: int = QUEUE_DEPTH) -> None:
        self._store = store
        self._layout = layout
        self._depth = depth
        self._queue: queue.SimpleQueue[Batch | threading.Event] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # blocks offered and not yet written (or given up)
        self.dropped = 0  # since start: blocks refused because the queue was full
        self.bytes_written = 0  # since start
        self.stopped = False  # a write failed: the tier takes no more blocks
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def room(self) -> int:
        """How many blocks an offer may hold now (asked before copying them out of the pool)."""
        if self.stopped:
            return 0
        with self._lock:
            return max(0, self._depth - self._queued)

    def offer(self, hashes: list[int], blocks: torch.Tensor) -> bool:
        """Queue `blocks` ([layers, len(hashes), ...], one per hash, on the CPU) whole; False
        (counted as dropped) when they do not fit the queue."""
        if self.stopped:
            return False
        with self._lock:
            if self._queued + len(hashes) > self._depth:
                self.dropped += len(hashes)
                return False
            self._queued += len(hashes)
        raw = blocks.contiguous().view(torch.uint8).numpy()  # a view of the gather's copy
        self._queue.put((hashes, raw.reshape(raw.shape[0], len(hashes), -1)))
        return True

    def drop(self, num_blocks: int) -> None:
        """Count blocks not offered because `room` said no."""
        with self._lock:
            self.dropped += num_blocks

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued block is written (or dropped); False past `timeout`."""
        done = threading.Event()  # set by the writer: everything queued before it is done
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.stopped = True
        self.flush(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            hashes, blocks = item
            for index, block_hash in enumerate(hashes):
                if not self.stopped:
                    self._write(block_hash, blocks[:, index])
                with self._lock:
                    self._queued -= 1

    def _write(self, block_hash: int, block: np.ndarray) -> None:
        """Store one block ([L, bytes a layer]); the first failure stops the writer."""
        payload = np.ascontiguousarray(block).reshape(-1)  # [L * bytes a layer]
        parts = entry_parts(self._layout, block_hash, [payload])
        try:
            if self._store.put(block_hash, parts):
                self.bytes_written += sum(len(part) for part in parts)
        except OSError as exc:
            self.stopped = True
            log.error("KV tier: stopped writing to %s: %s", self._store.path, exc)
