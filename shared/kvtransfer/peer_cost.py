"""`PeerReadCost`: is reading prefix blocks from another worker cheaper than computing them?

Both sides are measured. A read's cost is its fixed part (the pin's round trip and the
READ's set-up: the EWMA of the pin answers' seconds) plus its bytes over the measured READ
bandwidth (an EWMA of bytes per second of READ). The recompute cost of those blocks' tokens
is tokens / the worker's measured prefill rate (services/worker/step_costs.py).

The one subtle rule: until both are measured a read is made, so that the first reads
measure the link; once they are, a read dearer than computing is never made, until a slower
prefill rate (a busier engine) makes it pay again.
"""

from __future__ import annotations

ALPHA = 0.2  # weight of the newest read in the averages


class PeerReadCost:
    def __init__(self) -> None:
        self.fixed_s = 0.0  # EWMA of a pin's round trip; 0: not measured yet
        self.bytes_per_s = 0.0  # EWMA of READ bandwidth; 0: not measured yet

    def observe(self, fixed_s: float, num_bytes: int, read_s: float) -> None:
        """One read: its pin's round trip, then `num_bytes` READ in `read_s` seconds."""
        self.fixed_s = _ewma(self.fixed_s, max(fixed_s, 0.0))
        if num_bytes > 0 and read_s > 0:
            self.bytes_per_s = _ewma(self.bytes_per_s, num_bytes / read_s)

    def seconds(self, num_bytes: int) -> float:
        """The predicted seconds of a read of `num_bytes` (0: not measured yet)."""
        if self.bytes_per_s <= 0:
            return 0.0
        return self.fixed_s + num_bytes / self.bytes_per_s

    def pays(self, num_bytes: int, num_tokens: int, prefill_rate: float) -> bool:
        """Is reading `num_bytes` cheaper than computing `num_tokens` (or not yet known)?"""
        if self.bytes_per_s <= 0 or prefill_rate <= 0:
            return True
        return self.seconds(num_bytes) < num_tokens / prefill_rate


def _ewma(value: float, sample: float) -> float:
    return sample if value == 0.0 else value + ALPHA * (sample - value)
