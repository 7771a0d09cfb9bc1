"""Greedy decoding's argmax in C++ (csrc/cpu/argmax.cpp) gives torch.argmax's index on every
row: ties to the lowest index, a NaN as the maximum, rows of any length and stride; and the
sampler takes it for CPU logits when it has the kernels."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.sampler import Sampler, SamplingRow
from shared.engine.sampling_params import SamplingParams

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels not built")


@pytest.mark.parametrize("n", [1, 5, 16, 17, 100, 49152])
def test_random_rows_match_torch(n):
    logits = torch.randn(33, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_infinities_and_nans_match_torch():
    n = 70
    rows = torch.zeros(8, n)
    rows[0, [3, 40, 69]] = 5.0  # ties in different lanes: the lowest index
    rows[1, [35, 19]] = 5.0  # a later vector's lane below the earlier tie's lane
    rows[2] = -torch.inf  # all -inf: index 0
    rows[3, 50] = torch.inf
    rows[4, [20, 60]] = torch.nan  # the first NaN
    rows[5, [2, 66]] = torch.tensor([torch.inf, torch.nan])  # a NaN beats +inf
    rows[6] = -1.0  # no padding lane (0.0) may win a negative row
    rows[6, 68] = -0.5
    rows[7, 0], rows[7, 1] = -0.0, 0.0  # equal: the first
    assert torch.equal(kernels.argmax_rows(rows), rows.argmax(dim=-1))


def test_strided_rows_and_bad_input():
    wide = torch.randn(6, 130, generator=torch.Generator().manual_seed(1))
    view = wide[:, :100]  # the sampler's cut of a padded vocabulary
    assert torch.equal(kernels.argmax_rows(view), view.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(wide.double())
    with pytest.raises(RuntimeError, match="rows contiguous"):
        kernels.argmax_rows(wide.t())


def test_the_sampler_picks_the_same_greedy_tokens_with_the_kernels():
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(2))
    logits[4, [7, 9]] = 50.0  # a greedy row with a tie
    greedy = SamplingParams(temperature=0.0)
    seeded = SamplingParams(temperature=0.8, seed=5)
    rows = [SamplingRow(greedy if i % 3 else seeded, 5, i, [1, 2], [], None) for i in range(12)]
    with_kernels = Sampler(290, (0,), kernels)(logits, rows)
    without = Sampler(290, (0,))(logits, rows)
    assert [t.token_id for t in with_kernels] == [t.token_id for t in without]
    assert with_kernels[4].token_id == 7
