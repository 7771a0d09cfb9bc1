"""The engine's second KV tier: prefix blocks evicted from the pool, kept in a bounded store
(a directory in /dev/shm or on disk) and loaded back on a prefix hit when that is cheaper
than recomputing them.

Files, in the order a block passes through them: tier.py (`KVTier`: save at eviction, load
at admission), writer.py (the writer thread, bounded queue), entry.py (header, checksum,
refusals), store.py (the directory, its LRU and size limit), prefetch.py (the loader thread:
reads beside the step), policy.py (load or recompute). peer.py: prefix blocks read from
another worker's pool into this one's.
"""
