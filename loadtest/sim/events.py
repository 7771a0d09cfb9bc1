"""The event loop: a heap of (time, seq, event) over simulated time.

The one subtle rule: nothing here reads the wall clock, and ties in time break on the order
events were scheduled (`seq`), never on the events themselves; with the loop's seeded `rng`
as the only source of chance, the same seed and inputs replay the same run bit for bit.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

Event = Callable[[], None]


class EventLoop:
    def __init__(self, seed: int) -> None:
        self.now = 0.0  # seconds of simulated time
        self.rng = random.Random(seed)
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0
        self.handled = 0  # events run so far

    def at(self, when: float, event: Event) -> None:
        """Run `event` at simulated time `when` (never before now)."""
        heapq.heappush(self._heap, (max(when, self.now), self._seq, event))
        self._seq += 1

    def after(self, delay: float, event: Event) -> None:
        self.at(self.now + delay, event)

    def run(self, until: float, done: Callable[[], bool] = lambda: False) -> None:
        """Run events in time order until none is left, the next is past `until`, or
        `done()` holds after one."""
        while self._heap and self._heap[0][0] <= until:
            self.now, _, event = heapq.heappop(self._heap)
            event()
            self.handled += 1
            if done():
                return
