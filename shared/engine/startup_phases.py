"""The phases of a worker's start, from its process's start to serving, and a clock for them.

The engine times its own (weights loaded and packed, or mapped from the packed-weight
cache; the KV cache allocated) on the clock it
is built with; the worker adds the rest (services/worker/startup.py). The subtle rule: a
phase entered twice (a draft model's weights beside the target's) adds up, so each phase
is the time the start spent in it, whatever ran it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum


class StartupPhase(IntEnum):
    IMPORTS = 0  # process start → the worker's code (torch, the engine, vLLM) imported
    WEIGHTS_LOAD = 1  # safetensors read into tensors
    WEIGHTS_PACK = 2  # packed for the CPU kernels (or quantized), moved onto huge pages
    KV_ALLOCATION = 3  # the paged KV cache allocated
    ENGINE_REST = 4  # the rest of the engine's start (vLLM: all of it, compile included)
    KV_REGISTRATION = 5  # the KV transport's registration of the cache (NIXL)
    CONNECT = 6  # NATS connected, subscriptions made: serving from here
    FIRST_STEP = 7  # the first engine step (lazy compiles, warm-up), once it ran
    WEIGHTS_MAPPED = 8  # the packed-weight cache mapped, in place of loading and packing


class PhaseClock:
    """Seconds per phase, added up as the start goes through them."""

    def __init__(self) -> None:
        self.seconds: dict[StartupPhase, float] = {}

    @contextmanager
    def timing(self, phase: StartupPhase) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: StartupPhase, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
