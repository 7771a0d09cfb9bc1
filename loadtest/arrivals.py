"""When each request of an open-loop run is sent, as in `vllm bench serve`.

Gaps are gamma-distributed with shape = burstiness and mean = 1 / rate: burstiness 1 is a
Poisson process, below 1 burstier, above 1 more regular. rate = inf sends all at once.
Trace datasets carry their own timestamps, which win over the rate.
"""

from __future__ import annotations

import math

import numpy as np

from loadtest.request import BenchRequest


def gamma_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start, for n requests."""
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("request rate must be positive")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def send_offsets(
    requests: list[BenchRequest], rate: float, burstiness: float, seed: int = 0
) -> list[float]:
    if requests and all(r.timestamp is not None for r in requests):
        start = min(r.timestamp for r in requests if r.timestamp is not None)
        return [r.timestamp - start for r in requests if r.timestamp is not None]
    return gamma_offsets(len(requests), rate, burstiness, seed)
