"""The k-quants' kernel on panels of 16 columns (csrc/cpu/linear_kquant16.cpp): from the
repacked layout it gives the int8 path's generic bits (kernel "int8-generic") for every number
of rows, on K of 1536 and 8960 and a last panel narrower than 16 columns."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from loadtest.engine_bench.group_quant import gguf_matrix
from shared.engine import native
from shared.engine.model.group_quant import GroupQuantLinear

kernels = native.load()
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.int8_dot_product_kernel(), reason="no AVX512-VNNI kernels"
)
N = 2 * 16 + 5  # two whole panels and one of 5 columns


def repacked(w: GroupQuantLinear) -> tuple:
    empty = torch.empty(0)
    parts = [w.low, w.high, w.super_scale, w.sub_scale, w.super_min, w.sub_min]
    return tuple(
        kernels.repack_kquant16(
            *[empty if p is None else p for p in parts], w.bits, w.group, w.zero
        )
    )


def interleaved(w: GroupQuantLinear, packed: tuple, x: torch.Tensor) -> torch.Tensor:
    return kernels.linear_kquant16(x, *packed, w.bits, w.group, w.zero, w.out_features)


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] = 0.0  # a zero and an outlier per row: blocks of very different ranges
    x[:, 100] *= 30
    return x


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [1536, 8960])
def test_every_row_count_gets_the_generic_int8_bits(qtype, k):
    w = gguf_matrix(qtype, N, k, np.random.default_rng(k))
    packed = repacked(w)
    assert [p.numel() for p in packed] == [
        0 if p is None else p.numel()
        for p in (w.low, w.high, w.super_scale, w.sub_scale, w.super_min, w.sub_min)
    ]  # a permutation: no byte more
    x = rows(64, k, seed=k)
    generic = kernels.linear_group_quant(x, *w.kernel_args(), "int8-generic")
    for m in [*range(1, 17), 64]:
        assert torch.equal(interleaved(w, packed, x[:m]), generic[:m]), m
