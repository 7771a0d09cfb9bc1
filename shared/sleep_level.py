"""A worker's sleep level (vLLM's sleep levels), carried by its heartbeats and by the sleep
commands of shared/sleep_messages.py. The subtle rule: any level but AWAKE keeps the worker
out of the scheduler's candidates, whatever it still holds while falling asleep.
"""

from __future__ import annotations

from enum import IntEnum


class SleepLevel(IntEnum):
    AWAKE = 0
    KV_FREED = 1  # its KV pool given back; its weights kept (waking up is quick)
    WEIGHTS_FREED = 2  # its weights given back too (waking up loads them again)
