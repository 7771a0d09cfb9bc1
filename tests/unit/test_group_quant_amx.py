"""The GGUF formats on AMX-INT8 tiles (kernel "int8-amx"): the k-quants Q2_K to Q6_K
(csrc/cpu/linear_kquant_amx.cpp over repack_kquant_amx's panels) and the one-group formats
Q4_0 to Q8_0 (linear_blocks_amx.cpp over repack_blocks_amx's): the int8 path's result within
float rounding, bitwise the same for a row whatever rows and threads share its call (the
engine takes this path for every row count where the tiles run), and a repacked matrix
refused where the stored layout is read. Runs where the CPU has AMX and the OS grants the
tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from loadtest.engine_bench.group_quant import gguf_matrix
from shared.engine import native
from tests.unit.torch_threads import torch_threads

kernels = native.load()
pytestmark = pytest.mark.skipif(
    kernels is None or kernels.amx_tiles() != "on", reason="no AMX tiles here"
)
N = 3 * 16


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] = 0.0  # a zero and an outlier per row: blocks of very different ranges
    x[:, k // 2 + 3] *= 30
    return x


KQUANTS = [(q, k) for q in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) for k in (256, 1536)]
# one tile step of two blocks; SmolLM2's hidden size (spans of 8, 8, 2 blocks); qwen2.5's 0.5B
ONE_GROUP = [(q, k) for q in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0) for k in (64, 576, 896)]


@pytest.mark.parametrize(
    ("qtype", "k"), KQUANTS + ONE_GROUP, ids=lambda v: v.name if isinstance(v, T) else str(v)
)
def test_the_int8_sums_and_the_same_bits_for_every_row_count(qtype, k):
    w = gguf_matrix(qtype, N, k, np.random.default_rng(k))
    amx = w.with_int8_activations(vector=True, amx=True)
    assert amx.kernel == "int8-amx"
    assert [t.numel() for t in amx.tensors()] == [t.numel() for t in w.tensors()]  # no byte more
    x = rows(150, k, seed=k)  # past one chunk of 128 rows
    y = amx(x)
    exact = kernels.linear_group_quant(x, *w.kernel_args(), "int8-generic")
    assert torch.allclose(y, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    for m in [*range(1, 18), 33, 129]:
        assert torch.equal(amx(x[:m]), y[:m]), m
    assert torch.equal(amx(x[140:141]), y[140:141])  # a row alone, from a later chunk
    with torch_threads(1):
        assert torch.equal(amx(x), y)


def test_a_repacked_matrix_is_no_stored_layout():
    w = gguf_matrix(T.Q4_K, N, 256, np.random.default_rng(0))
    amx = w.with_int8_activations(vector=True, amx=True)
    with pytest.raises(ValueError, match="AMX panels"):
        amx.take_rows(torch.arange(16))
    with pytest.raises(ValueError, match="AMX panels"):
        amx.dequantize()
    assert not amx.stacks_with(w)
    narrow = gguf_matrix(T.Q4_K, N + 5, 256, np.random.default_rng(0))  # not whole panels
    assert narrow.with_int8_activations(vector=True, amx=True).kernel == "int8"
    with pytest.raises(RuntimeError, match="16-column panels"):
        kernels.linear_group_quant(rows(1, 256, 0), *narrow.kernel_args(), "int8-amx")


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_one_group_panels_are_no_stored_layout_and_narrow_ones_stay(qtype):
    w = gguf_matrix(qtype, N, 64, np.random.default_rng(1))
    amx = w.with_int8_activations(vector=True, amx=True)
    assert amx.kernel == "int8-amx"
    with pytest.raises(ValueError, match="AMX panels"):
        amx.dequantize()
    assert not amx.stacks_with(w)
    narrow = gguf_matrix(qtype, N + 8, 64, np.random.default_rng(1))
    assert narrow.with_int8_activations(vector=True, amx=True).kernel == "int8"
    with pytest.raises(RuntimeError, match="16-column panels"):
        kernels.linear_group_quant(rows(1, 64, 0), *narrow.kernel_args(), "int8-amx")
