"""`LoadPolicy`: load blocks from the tier only when that is cheaper than computing them.

Both sides are measured: the tier times its own loads (seconds per block, read, checked and
written into the pool), and whoever times the engine's steps hands it the prefill rate
(prompt tokens per second, services/worker/step_costs.py). A run of n blocks is loaded when
n x load seconds per block < n x block size / prefill rate.

The one subtle rule: until both are measured, blocks are loaded, so that the first loads
measure the tier; once they are, a tier slower than recomputing is never read again until
the prefill rate says recomputing got slower (a busier engine) — never slower than it.
"""

from __future__ import annotations

ALPHA = 0.2  # weight of the newest load in the average
DEFAULT_WAIT_S = 0.05  # how long a request may wait for its loads before the rate is known


class LoadPolicy:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.load_s_per_block = 0.0  # EWMA; 0: not measured yet
        self.prefill_rate = 0.0  # prompt tokens per second; 0: not measured yet

    def observe_load(self, seconds: float, num_blocks: int) -> None:
        if num_blocks <= 0:
            return
        sample = seconds / num_blocks
        if self.load_s_per_block == 0.0:
            self.load_s_per_block = sample
        else:
            self.load_s_per_block += ALPHA * (sample - self.load_s_per_block)

    def pays(self) -> bool:
        """Is loading a block cheaper than recomputing its tokens (or not yet known)?"""
        if self.load_s_per_block == 0.0 or self.prefill_rate <= 0.0:
            return True
        return self.load_s_per_block < self.block_size / self.prefill_rate

    def wait_s(self, num_blocks: int) -> float:
        """How long a request may wait for `num_blocks` to come from the tier beside the
        steps: no longer than computing them would take (a fixed bound until measured)."""
        if self.prefill_rate <= 0.0:
            return DEFAULT_WAIT_S
        return num_blocks * self.block_size / self.prefill_rate
