"""The dot-product linear kernels: bf16 pairs (csrc/cpu/linear_bf16.cpp, AVX512-BF16) and
W8A8 int8 quads (csrc/cpu/linear_int8.cpp, AVX512-VNNI). Accuracy against float64 on shapes
with tails, and bitwise row invariance across batch sizes, offsets and thread counts (the
fp32 FMA chain's thread counts too) — the property seeded migration rests on. Each kernel's
tests skip on a CPU without its instructions (the engine then takes the FMA chain or
torch's kernel and says so in the log)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.engine import native
from shared.engine.model.linear_weights import Int8DotLinear, PackedLinear

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels not built")
needs_bf16 = pytest.mark.skipif(
    kernels is None or not kernels.bf16_dot_product_kernel(), reason="no AVX512-BF16"
)
needs_vnni = pytest.mark.skipif(
    kernels is None or not kernels.int8_dot_product_kernel(), reason="no AVX512-VNNI"
)
SHAPES = [(64, 64), (67, 33), (576, 960), (1536, 576), (5, 1), (1, 17)]  # (K, N)


def _layer_and_rows(kind: str, k: int, n: int, m: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=gen) * 0.1, torch.randn(m, k, generator=gen)
    if kind == "fp32":
        return PackedLinear.pack(w), x
    if kind == "bf16":
        return PackedLinear.pack(w.bfloat16()), x.bfloat16()
    return Int8DotLinear.quantize(w), x


@needs_bf16
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}")
def test_bf16_pairs_match_float64(shape):
    k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    w, bias = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    layer = PackedLinear.pack(w)
    assert layer.packed.shape == (-(-n // 64), -(-k // 32) * 16, 128)  # the pair layout
    for m in (1, 3, 6, 7, 100):
        x = torch.randn(m, k, generator=gen).bfloat16()
        y = layer(x, bias.bfloat16())
        reference = F.linear(x.double(), w.double(), bias.bfloat16().double())
        # the largest |y| could be: the rounding's bound is relative to it
        scale = (x.abs().double() @ w.abs().double().t() + bias.abs().double()).max().item()
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # fp32 sums of exact products, then one bf16 rounding (2**-8 relative)
        assert (y.double() - reference).abs().max().item() <= 2**-8 * scale + 1e-5 * scale


@needs_vnni
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}")
def test_int8_quads_match_the_quantized_product(shape):
    k, n = shape
    gen = torch.Generator().manual_seed(k * 7 + n)
    w, x = torch.randn(n, k, generator=gen) * 0.1, torch.randn(9, k, generator=gen)
    layer = Int8DotLinear.quantize(w)
    # the exact reference: x quantized per row as the kernel does, times the int8 weight
    sx = x.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(x / sx).clamp(-127, 127)
    reference = (xq.double() @ layer.dequantize().double().t()) * sx.double()
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (9, n)
    assert torch.allclose(y.double(), reference, rtol=1e-5, atol=1e-5)
    assert (layer.dequantize() - w).abs().max() <= w.abs().max() / 127  # half a step, twice


@needs_vnni
def test_int8_handles_zero_rows_and_bias():
    layer = Int8DotLinear.quantize(torch.randn(70, 33))
    bias = torch.randn(70)
    y = layer(torch.zeros(2, 33))
    assert torch.equal(y, torch.zeros(2, 70))
    with_bias = native.load().linear_int8(
        torch.zeros(2, 33), layer.packed, layer.scales, layer.colsums, 70, bias
    )
    assert torch.equal(with_bias, bias.expand(2, 70))


@pytest.mark.parametrize(
    "kind", [pytest.param("bf16", marks=needs_bf16), pytest.param("int8", marks=needs_vnni)]
)
def test_a_row_is_bitwise_the_same_for_every_batch_size(kind):
    layer, x = _layer_and_rows(kind, 576, 130, 200)
    full = layer(x)
    for m in range(1, 201):
        assert torch.equal(layer(x[:m]), full[:m]), m
    for start in (1, 7, 100):
        assert torch.equal(layer(x[start : start + 5]), full[start : start + 5]), start


@pytest.mark.parametrize(
    "kind",
    ["fp32", pytest.param("bf16", marks=needs_bf16), pytest.param("int8", marks=needs_vnni)],
)
def test_rows_do_not_depend_on_the_thread_count(kind):
    layer, x = _layer_and_rows(kind, 576, 4099, 40, seed=2)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append([layer(x[:m]) for m in (1, 2, 7, 40)])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_the_start_up_log_names_the_path_each_setting_takes(tmp_path):
    from shared.engine import batch_invariant
    from shared.engine.engine_config import EngineConfig
    from shared.engine.resolve import resolve

    def path(**settings) -> str:
        config = resolve(EngineConfig(model_dir=tmp_path, **settings))
        packed = not config.quantization and batch_invariant.resolve(config)
        return batch_invariant.describe_matmuls(config, packed)

    amx = kernels.amx_tiles()
    if not kernels.bf16_dot_product_kernel():
        bf16 = "no AVX512-BF16"
    else:  # the tiles where they run, and why not where they do not
        bf16 = {"on": "bf16 AMX tiles", "refused": "refused AMX", "absent": "no AMX"}[amx]
    assert bf16 in path(dtype="bfloat16")
    assert "int8 weight-only through torch" in path(quantization="int8")
    if kernels.int8_dot_product_kernel():
        w8a8 = "W8A8 int8 AMX tiles" if amx == "on" else "W8A8 int8 dot products"
        assert w8a8 in path(quantization="w8a8")
    assert "fp32 FMA chain" in path(dtype="float32")
    assert bf16 in path()  # the default, dtype auto: bf16 wherever the kernels have AVX2
    assert "batch_invariant off" in path(batch_invariant=False)


def test_the_measured_core_peak_orders_the_instructions_as_their_widths():
    fp32 = kernels.core_peak_gops("fp32", 2_000_000)
    assert fp32 > 1  # Gop/s: any AVX2 or AVX-512 core does tens at least
    # 2 multiply-adds per lane where fp32 does 1; not on a Xeon with AMX (2026-12-07: vdpbf16ps
    # one a cycle against two FMAs, 110 against 225 Gop/s), where bf16 runs on the tiles
    if kernels.bf16_dot_product_kernel() and kernels.amx_tiles() == "absent":
        assert kernels.core_peak_gops("bf16", 2_000_000) > 1.3 * fp32
    if kernels.amx_tiles() == "on":
        assert kernels.core_peak_gops("amx_bf16", 2_000_000) > 4 * fp32
    with pytest.raises(RuntimeError, match="no fp8 multiply-add"):
        kernels.core_peak_gops("fp8")
