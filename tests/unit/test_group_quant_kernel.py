"""The group-quantized linear (csrc/cpu/linear_group_quant.cpp) on every kept GGUF format:
batch-invariant bit for bit (a row alone, in a few rows dequantized in registers, in many rows
through the scratch panel, on one thread or two), the generic path's bits equal the AVX-512
and AVX2 ones', bf16 rows are their fp32 widening, and the sums are within the documented bound
(docs/quantized-checkpoints.md: 1e-5 of sum |x * w|) of an fp64 product of the dequantized
weights."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.engine import native
from shared.engine.model.group_quant import GroupQuantLinear
from shared.models.gguf_quant import BLOCKS, unpack
from tests.unit.test_gguf_quant import K, N, gguf_bytes
from tests.unit.torch_threads import torch_threads

kernels = native.load()
pytestmark = pytest.mark.skipif(
    kernels is None or not hasattr(kernels, "linear_group_quant"),
    reason="the C++ kernels (with linear_group_quant) are not built",
)
FORMATS = sorted(BLOCKS, key=lambda t: t.name)
# "auto" (AVX-512, else AVX2) and, where the build has AVX2, its AVX2 path by name
AVX2 = kernels is not None and "avx2" in kernels.cpu_features()
VECTOR_PATHS = ["auto", "avx2"] if AVX2 else ["auto"]


def weight(qtype: T, seed: int = 0) -> GroupQuantLinear:
    arrays = unpack(gguf_bytes(qtype, seed), qtype, (N, K), "w")
    return GroupQuantLinear.from_tensors(
        arrays.params(), {name: torch.from_numpy(a) for name, a in arrays.arrays().items()}
    )


def rows(m: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_whatever_shares_its_call(qtype):
    w, x = weight(qtype), rows(13)
    together = w(x)
    assert together.dtype == torch.float32 and together.shape == (13, N)
    for i in (0, 6, 12):
        assert torch.equal(w(x[i : i + 1])[0], together[i])
    assert torch.equal(w(x[2:5]), together[2:5])  # in registers
    assert torch.equal(w(x[4:11]), together[4:11])  # through the scratch panel
    with torch_threads(1):
        assert torch.equal(w(x), together)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_the_generic_path_gives_the_vector_paths_bits(qtype, path):
    w = weight(qtype, seed=2)
    for m in (1, 2, 3, 5, 9):  # AVX2: tiles of 1 x 4 or 2 x 2, the panel past 2 rows
        x = rows(m, seed=m)
        generic = kernels.linear_group_quant(x, *w.kernel_args(), kernel="generic")
        assert torch.equal(generic, kernels.linear_group_quant(x, *w.kernel_args(), kernel=path))
    fewer = w.take_rows(torch.arange(N - 3))  # a last block of 1 column
    x = rows(5, seed=4)
    generic = kernels.linear_group_quant(x, *fewer.kernel_args(), kernel="generic")
    assert torch.equal(generic, kernels.linear_group_quant(x, *fewer.kernel_args(), kernel=path))


def test_auto_takes_the_builds_vector_path():
    fp32, _ = kernels.group_quant_paths()
    features = kernels.cpu_features()
    want = "avx512" if "avx512f" in features else "avx2" if "avx2" in features else "generic"
    assert fp32 == want


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_sums_are_within_the_bound_of_the_dequantized_product(qtype):
    w, x = weight(qtype, seed=3), rows(7, seed=3)
    dense = w.dequantize().double()
    exact = x.double() @ dense.T
    scale = x.double().abs() @ dense.abs().T
    assert ((w(x).double() - exact).abs() <= 1e-5 * scale + 1e-30).all()


def test_bf16_rows_are_their_fp32_widening():
    w, x = weight(T.Q4_K), rows(5).bfloat16()
    assert torch.equal(w(x), w(x.float()))


def test_a_layout_that_does_not_fit_is_refused():
    w = weight(T.Q5_0)
    args = list(w.kernel_args())
    args[2] = args[2][:, :, :-1].contiguous()  # the bit planes one byte short per row
    with pytest.raises(RuntimeError, match="high does not fit"):
        kernels.linear_group_quant(rows(2), *args)
