"""The group-quantized linear with int8 activations (csrc/cpu/linear_group_quant_int8.cpp) on
every kept GGUF format and the AWQ / GPTQ layouts: the AVX512-VNNI and AVX2 paths' bits equal
their generic model's, a row gets the same bits whatever shares its call, and the result is within
the bound that quantizing x per block allows (docs/quantized-checkpoints.md)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.engine import native
from shared.engine.model.group_quant import GroupQuantLinear
from shared.engine.model.wna16_linear import wna16_linear
from shared.models.gguf_quant import BLOCKS
from shared.models.wna16_config import QuantFormat, parse_config
from tests.unit.test_gguf_quant import K, N
from tests.unit.test_group_quant_kernel import weight
from tests.wna16_writer import Scheme, quantize

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ kernels are not built")
AVX2 = kernels is not None and "avx2" in kernels.cpu_features()
VECTOR = kernels is not None and kernels.group_quant_paths()[1] != "generic"
# the vector paths by name: "int8" (AVX512-VNNI, else AVX2) and AVX2's own
VECTOR_PATHS = (["int8"] if VECTOR else []) + (["int8-avx2"] if AVX2 else [])
SCHEMES = {
    "awq-g128": Scheme(QuantFormat.AWQ, 4, 128, symmetric=False),
    "gptq4-g32-act-order": Scheme(QuantFormat.GPTQ, 4, 32, symmetric=False, act_order=True),
    "gptq8-g64": Scheme(QuantFormat.GPTQ, 8, 64, symmetric=False),
    "gptq8-channel-sym": Scheme(QuantFormat.GPTQ, 8, 0, symmetric=True),
}


def gguf_weight(qtype: T) -> GroupQuantLinear:
    return weight(qtype, seed=3)


def wna16_weight(name: str) -> GroupQuantLinear:
    scheme = SCHEMES[name]
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(4)) * 0.05
    m = quantize(w, scheme.bits, scheme.group, scheme.symmetric, scheme.act_order)
    return wna16_linear(parse_config(scheme.config()), scheme.parts(m))


WEIGHTS = [(t.name, lambda t=t: gguf_weight(t)) for t in sorted(BLOCKS, key=lambda t: t.name)]
WEIGHTS += [(name, lambda name=name: wna16_weight(name)) for name in SCHEMES]


def rows(m: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed))
    x[:, 7] = 0.0  # a zero and an outlier per row: blocks of very different ranges
    x[:, 100] *= 30
    return x


def int8(w: GroupQuantLinear, x: torch.Tensor, kernel: str = "int8") -> torch.Tensor:
    if w.in_perm is not None:
        x = x.index_select(1, w.in_perm)
    return kernels.linear_group_quant(x, *w.kernel_args(), kernel)


def test_each_row_is_quantized_per_block_to_round_half_even_of_x_over_d():
    # through the identity as 8-bit codes of scale 1: y[m, k] = xq[m, k] * d[m, k's block]
    eye = GroupQuantLinear(
        format="Q8_0",
        out_features=K,
        in_features=K,
        bits=8,
        group=32,
        per_super=1,
        zero=0,
        super_scale=torch.ones(K, K // 32),
        codes=torch.eye(K, dtype=torch.int8),
    )
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5)) * 4
    x[0, :32] = torch.arange(-15.5, 16.5)  # amax 15.5: d = 15.5 / 127, every code exact
    x[1, :32] = 0.0  # d = 0
    x[1, 32:64] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5] + [0.0] * 25)  # d = 1: ties
    for kernel in [*VECTOR_PATHS, "int8-generic"]:
        y = int8(eye, x, kernel)
        blocks = x.view(3, -1, 32)
        d = (blocks.abs().amax(-1, keepdim=True) / 127).expand(-1, -1, 32).reshape(3, K)
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        xq = torch.round(x * inverse)  # round half to even, as nearbyint
        assert xq.abs().max() <= 127
        assert torch.equal(y, xq * d), kernel
    assert y[1, 32:39].tolist() == [127.0, 2.0, 4.0, -2.0, -0.0, 0.0, 2.0]


@pytest.mark.parametrize(("name", "make"), WEIGHTS, ids=[n for n, _ in WEIGHTS])
@pytest.mark.parametrize("kernel", VECTOR_PATHS)
def test_the_vector_paths_give_their_generic_models_bits(name, make, kernel):
    w = make()
    assert w.int8_fits, name
    for m in (1, 2, 3, 5, 9):  # in registers, and through the unpacked codes' panel
        x = rows(m, seed=m)
        assert torch.equal(int8(w, x, kernel), int8(w, x, "int8-generic")), m
    fewer = w.take_rows(torch.arange(N - 3))  # a last block of 1 column
    x = rows(5, seed=6)
    assert torch.equal(int8(fewer, x, kernel), int8(fewer, x, "int8-generic"))


def test_the_int8_kernel_takes_the_builds_vector_path():
    features = kernels.cpu_features()
    vnni = "avx512_vnni" in features and "avx512f" in features
    want = "avx512_vnni" if vnni else "avx2" if "avx2" in features else "generic"
    assert kernels.group_quant_paths()[1] == want


@pytest.mark.parametrize(("name", "make"), WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_a_row_gets_the_same_bits_whatever_shares_its_call(name, make):
    w = make().with_int8_activations(VECTOR)
    x = rows(13)
    together = w(x)
    for i in (0, 6, 12):
        assert torch.equal(w(x[i : i + 1])[0], together[i])
    assert torch.equal(w(x[2:5]), together[2:5])
    assert torch.equal(w(x[4:11]), together[4:11])


@pytest.mark.parametrize(("name", "make"), WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_each_row_gets_its_own_bits_at_every_tile_boundary(name, make):
    w = make().with_int8_activations(VECTOR)
    x = rows(13, seed=5)
    alone = torch.cat([w(x[i : i + 1]) for i in range(13)])  # [13, N]
    for m in (1, 3, 4, 5, 6, 7, 8, 9, 13):  # tiles of 4 rows; more than 4: the codes' panel
        assert torch.equal(w(x[:m]), alone[:m]), m
    fewer = w.take_rows(torch.arange(N - 2))  # a last block of 2 columns, not 4
    for m in (1, 6, 13):
        assert torch.equal(fewer(x[:m]), alone[:m, : N - 2]), m


@pytest.mark.parametrize(("name", "make"), WEIGHTS, ids=[n for n, _ in WEIGHTS])
def test_the_sums_are_within_the_activation_quantizations_bound(name, make):
    w = make()
    x = rows(5, seed=9)
    y = w.with_int8_activations(VECTOR)(x).double()
    dense = w.dequantize().double()  # [N, K], the matrix's own column order
    exact = x.double() @ dense.t()
    # xq = round(x / d) per x-block (in the stored column order): |x - d xq| <= d / 2
    span = 32 if w.per_super == 1 else min(w.group * w.per_super, 256)
    stored = x.index_select(1, w.in_perm) if w.in_perm is not None else x
    amax = stored.abs().view(5, -1, span).amax(-1, keepdim=True).expand(-1, -1, span)
    step = (amax.reshape(5, K) / 127).double()
    if w.in_perm is not None:
        step = torch.empty_like(step).index_copy_(1, w.in_perm, step)
    bound = (step / 2) @ dense.abs().t() * 1.001 + 1e-5 * (x.abs().double() @ dense.abs().t())
    assert bool(((y - exact).abs() <= bound).all())
    plain = torch.randn(5, K, generator=torch.Generator().manual_seed(10))  # no outliers
    y, exact = w.with_int8_activations(VECTOR)(plain).double(), plain.double() @ dense.t()
    assert float((y - exact).norm() / exact.norm()) < 0.02  # far inside the bound on the whole


def test_a_layout_the_int8_kernel_does_not_take_stays_on_the_float_kernel():
    w = gguf_weight(T.Q4_0)
    odd = GroupQuantLinear.from_tensors(
        {
            "format": "Q4_0",
            "bits": 4,
            "group": 32,
            "per_super": 1,
            "zero": 8,
            "parts": "low,super_scale",
        },
        {"low": w.low[:, : 16 * 3].contiguous(), "super_scale": w.super_scale[:, :3].contiguous()},
    )  # K = 96: not whole pairs of 32-blocks
    assert not odd.int8_fits
    assert odd.with_int8_activations(VECTOR).kernel == "auto"
    with pytest.raises(RuntimeError, match="int8 activations need K in whole 64s"):
        kernels.linear_group_quant(torch.randn(1, 96), *odd.kernel_args(), "int8")


def test_group_scales_in_super_blocks_take_the_int8_kernel_only_as_k_quants_have_them():
    q6 = gguf_weight(T.Q6_K)  # 6-bit codes, 16 groups of 16 in super-blocks of 256
    assert q6.int8_fits
    wide = GroupQuantLinear.from_tensors(
        {
            "format": "test",
            "bits": 8,
            "group": 16,
            "per_super": 16,
            "zero": 0,
            "parts": "codes,super_scale,sub_scale",
        },
        {
            "codes": torch.zeros(N, K, dtype=torch.int8),
            "super_scale": q6.super_scale,
            "sub_scale": q6.sub_scale,
        },
    )  # 8-bit codes times int8 activations: their pairs do not fit int16
    assert not wide.int8_fits
    assert wide.with_int8_activations(VECTOR).kernel == "auto"
    with pytest.raises(RuntimeError, match="int8 activations need"):
        kernels.linear_group_quant(torch.randn(1, K), *wide.kernel_args(), "int8")
