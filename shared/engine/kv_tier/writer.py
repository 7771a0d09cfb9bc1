"""`TierWriter`: the thread that writes evicted blocks to the tier, off the engine's step.

The engine thread `offer`s a block (its bytes already copied out of the pool) and goes on;
the writer encodes and stores it. The queue is bounded: when the writer is behind, an offer
is refused and counted (`dropped`), never waited for. The one subtle rule: the first write
that fails (a full disk, a removed directory) stops every later one for good and is logged
once (`stopped`); the blocks are then recomputed as they would be without a tier.
"""

from __future__ import annotations

import logging
import queue
import threading

from shared.engine.kv_tier.entry import TierLayout, encode_entry
from shared.engine.kv_tier.store import TierStore

log = logging.getLogger(__name__)

QUEUE_DEPTH = 256  # blocks waiting to be written, at most


class TierWriter:
    def __init__(self, store: TierStore, layout: TierLayout, depth: int = QUEUE_DEPTH) -> None:
        self._store = store
        self._layout = layout
        self._queue: queue.Queue[tuple[int, bytes] | threading.Event] = queue.Queue(depth)
        self.dropped = 0  # since start: offers refused because the queue was full
        self.bytes_written = 0  # since start
        self.stopped = False  # a write failed: the tier takes no more blocks
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def can_take(self) -> bool:
        """Would an offer be queued now? (Asked before copying a block out of the pool.)"""
        return not self.stopped and not self._queue.full()

    def offer(self, block_hash: int, payload: bytes) -> bool:
        if self.stopped:
            return False
        try:
            self._queue.put_nowait((block_hash, payload))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def drop(self) -> None:
        """Count a block not offered because `can_take` said no."""
        self.dropped += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued block is written (or dropped); False past `timeout`."""
        done = threading.Event()  # set by the writer: everything queued before it is done
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
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
            if self.stopped:
                continue
            block_hash, payload = item
            data = encode_entry(self._layout, block_hash, payload)
            try:
                if self._store.put(block_hash, data):
                    self.bytes_written += len(data)
            except OSError as exc:
                self.stopped = True
                log.error("KV tier: stopped writing to %s: %s", self._store.path, exc)
