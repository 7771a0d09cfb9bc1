"""What a worker's heartbeat says about its second KV tier (shared/engine/kv_tier/), for the
scheduler's /mesh view and the routing that weighs a block by where it is.

`TierCounters` are the tier's counters since the worker started, as `TierStats` has them
(all 0: no tier). The subtle rule: they are cumulative, never deltas, so a lost heartbeat
loses nothing and a reader subtracts two beats for a rate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TierCounters:
    capacity_bytes: int = 0  # the tier's size limit; 0: the worker has no tier
    stored_bytes: int = 0  # now
    hits: int = 0  # blocks loaded back into the pool
    refused: int = 0  # entries refused (bad checksum, foreign, truncated) and recomputed
    skipped: int = 0  # blocks held but recomputed, since loading cost more
    bytes_in: int = 0  # bytes read back
    bytes_out: int = 0  # bytes written
    load_seconds: float = 0.0  # spent loading
    prefetched: int = 0  # of the hits, blocks read beside an earlier step
    late: int = 0  # blocks recomputed since their read passed its deadline
    evictions: int = 0  # entries dropped for room
    dropped_writes: int = 0  # evicted blocks not written: the writer was behind
    unwritten: int = 0  # evicted blocks not written: no evicted block was seen to return
    write_stopped: bool = False  # a write failed (full disk): it writes no more
