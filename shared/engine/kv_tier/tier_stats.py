"""`TierStats`: the second KV tier's counters, as the engine reports them (stats.py) and the
worker turns them into metrics. Pure data: no torch, so anything may import it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierStats:
    """The tier's counters since start (all 0 when there is no tier)."""

    hits: int = 0  # blocks loaded back into the pool
    refused: int = 0  # entries refused (truncated, foreign, checksum, unreadable): recomputed
    skipped: int = 0  # blocks the tier held but recomputed, since loading cost more
    bytes_in: int = 0  # entry bytes read back
    bytes_out: int = 0  # entry bytes written
    load_seconds: float = 0.0  # spent loading in the step (read, check, write into the pool)
    prefetched: int = 0  # of the hits, blocks read beside an earlier step (loader thread)
    late: int = 0  # blocks recomputed since their read passed its deadline
    evictions: int = 0  # entries dropped to stay under the size limit
    dropped_writes: int = 0  # evicted blocks not written: the writer was behind
    unwritten: int = 0  # evicted blocks not written: no evicted block was seen to return
    stored_bytes: int = 0  # now
    capacity_bytes: int = 0  # the size limit; 0: no tier
    write_stopped: bool = False  # a write failed (full disk): no more are made
