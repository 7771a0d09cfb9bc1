"""A worker process's epoch: one number per process, fixed at its start, that fences off
every older process that ran under the same worker id.

It goes in the worker's heartbeats, its answer to a liveness `Probe`, its reservations, and
the KV offers and chunks it sends or is sent, so a scheduler and a peer always know which
process a message speaks for. The subtle rule: an epoch is the start time (microseconds)
followed by random bits, so a later process of the same id has a larger one; compare epochs
only within one worker id, and take 0 for "not said" (no check made).
"""

from __future__ import annotations

import secrets
import time

RANDOM_BITS = 10  # two processes started in the same microsecond still differ
NO_EPOCH = 0  # "not said": an old sender, or a message that names no process


def new_epoch() -> int:
    """This process's epoch: below 2**62 (a wire count) until the year 2100."""
    return (time.time_ns() // 1000) << RANDOM_BITS | secrets.randbits(RANDOM_BITS) | 1


def stale(epoch: int, current: int) -> bool:
    """Does a message of `epoch` speak for a process other than `current`? (0: unsaid.)"""
    return epoch != NO_EPOCH and current != NO_EPOCH and epoch != current
