"""Step coefficients (cost_model.py) fitted to timed steps by least squares.

Decode steps (no prompt token) fit fixed + decode_row × rows + decode_attn × context read;
prompt steps then fit prefill_token × tokens + prefill_attn × positions attended, on their
seconds less the fixed cost found from the decode steps. A timing may cover several steps
(a whole prompt's chunks): its features are the sums over them.

The one subtle rule: a coefficient never comes out negative (a negative term would make a
bigger step cheaper); a fit that wants one is refitted without that term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.sim.cost_model import StepCoefficients, attended_positions


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    """`chunks` (tokens, tokens before them), one step each, took `seconds` in all."""

    chunks: tuple[tuple[int, int], ...]
    seconds: float

    def features(self) -> tuple[float, float, float]:
        """(steps, tokens, positions attended)."""
        tokens = sum(n for n, _ in self.chunks)
        return len(self.chunks), tokens, sum(attended_positions(n, s) for n, s in self.chunks)


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    """One step of `rows` decode rows, each reading `context` tokens, took `seconds`."""

    rows: int
    context: int
    seconds: float


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop the most negative term, refit)."""
    keep = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        if keep:
            x[keep] = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        keep.remove(int(np.argmin(x)))


def fit_steps(
    prefills: Sequence[PrefillTiming], decodes: Sequence[DecodeTiming]
) -> StepCoefficients:
    fixed = row = attn = 0.0
    if decodes:
        a = np.array([[1.0, d.rows, d.rows * d.context] for d in decodes])
        fixed, row, attn = nonnegative_lstsq(a, np.array([d.seconds for d in decodes]))
    token = prompt_attn = 0.0
    if prefills:
        feats = np.array([p.features() for p in prefills], dtype=float)
        b = np.array([p.seconds for p in prefills]) - fixed * feats[:, 0]
        token, prompt_attn = nonnegative_lstsq(feats[:, 1:], b)
    return StepCoefficients(float(fixed), float(token), float(prompt_attn), float(row), float(attn))
