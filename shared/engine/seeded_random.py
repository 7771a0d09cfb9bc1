"""Seeded randomness for the sampler: a row's draw is a pure function of (seed, position).

`uniform` hashes (seed, position, stream) with splitmix64 into a float in [0, 1), so a
request continues exactly as it would have after migration, preemption or re-batching,
whatever else is in the batch and whatever the global torch RNG state. `draw` turns one
such number per row into a token by inverse-CDF sampling over the weights in token-id order.
Stream 0 is the sampler's; other streams are free for later users (speculative decoding).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """The splitmix64 step: advance by the golden gamma, then the finalizer."""
    z = (z + _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int, stream: int = 0) -> float:
    """A float in [0, 1) that depends only on (seed, position, stream), all in [0, 2**64)."""
    if not (0 <= seed <= _MASK64 and 0 <= position <= _MASK64 and 0 <= stream <= _MASK64):
        raise ValueError(
            f"seed, position, stream must be in [0, 2**64): {seed}, {position}, {stream}"
        )
    h = _mix64(_mix64(_mix64(seed) ^ position) ^ stream)
    return (h >> 11) * 2.0**-53  # top 53 bits: exactly representable, at most 1 - 2**-53


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids drawn with probability proportional to `weights`, one per row.

    weights: [M, V] float32, >= 0, at least one positive per row (need not sum to 1).
    u: [M] float64 in [0, 1). Returns [M] int64.
    A token of weight 0 is never drawn, even when rounding puts u * total at or past the end.
    """
    cdf = weights.cumsum(dim=-1)  # [M, V], non-decreasing; equal across zero-weight tokens
    target = (u * cdf[:, -1].double()).to(cdf.dtype)  # [M]
    # The first token whose cumulative weight exceeds the target; a zero-weight token never
    # is, since its cdf equals its predecessor's.
    chosen = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # [M]
    chosen.clamp_(max=weights.shape[1] - 1)
    drawn_zero = weights.gather(1, chosen[:, None]).squeeze(1) == 0  # [M]
    if drawn_zero.any():  # target rounded up to the total: take the last positive before it
        chosen[drawn_zero] = _last_positive_at_or_before(weights[drawn_zero], chosen[drawn_zero])
    return chosen


def _last_positive_at_or_before(weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """weights: [K, V]; index: [K]. The largest token id <= index with positive weight."""
    ids = torch.arange(weights.shape[1], device=weights.device)  # [V]
    allowed = (weights > 0) & (ids[None, :] <= index[:, None])  # [K, V]
    return torch.where(allowed, ids[None, :], -1).amax(dim=-1)
