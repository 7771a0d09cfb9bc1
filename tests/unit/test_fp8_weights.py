"""FP8 E4M3 weights, compressed-tensors float-quantized and vLLM's own `fp8`: read as
compressed-tensors' compressor writes them (per tensor, channel, group and block), their
weights its dequantize's in fp32 exactly, and vLLM's block-scaled ones as compressed-tensors'
FP8 block dequantizer reads them; the group-quant kernel's FP8 path gives the same bits on its
generic, AVX-512 and AVX2 paths, batch-invariantly, within fp32 rounding of the dequantized
product, with DAZ set too; refusals by name."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.model.wna16_linear import wna16_linear
from shared.models.fp8_weights import unpack_fp8
from shared.models.wna16_config import QuantFormat, Wna16Config, parse_config
from tests.wna16_writer import Scheme, fp8_quantize, spread

kernels = native.load()
N, K = 48, 256
CHANNEL = Wna16Config(QuantFormat.FP8, 8, 0, True)
TENSOR = Wna16Config(QuantFormat.FP8, 8, 0, True, per_tensor=True)
VLLM_BLOCKS = Wna16Config(QuantFormat.FP8_VLLM, 8, 128, True, block_rows=128)
PATHS = ["auto", "avx2"] if kernels is not None and "avx2" in kernels.cpu_features() else ["auto"]


def config(strategy: str = "channel", **weights) -> dict:
    """The writer's config (tests/wna16_writer.py), its weights' fields changed."""
    raw = Scheme(QuantFormat.FP8, 8, 0, True, strategy=strategy).config()
    raw["config_groups"]["group_0"]["weights"] |= weights
    return raw


def every_code(n: int = N, k: int = K) -> torch.Tensor:
    """[n, k] FP8 values: every code but the two NaNs (zeros, subnormals, the largest, both
    signs), then random ones."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    rest = torch.randint(
        0, 0x7E, (n * k - codes.numel(),), generator=torch.Generator().manual_seed(1)
    )
    signs = torch.randint(0, 2, rest.shape, generator=torch.Generator().manual_seed(2)) << 7
    flat = torch.cat([codes, (rest | signs).to(torch.uint8)])
    return flat.view(torch.float8_e4m3fn).reshape(n, k)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_float_quantized_unpacks_as_compressed_tensors_own_compressor(strategy):
    ct = pytest.importorskip("compressed_tensors.compressors")
    quantization = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = quantization.QuantizationArgs(num_bits=8, type="float", strategy=strategy)
    scheme = quantization.QuantizationScheme(targets=["Linear"], weights=args)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * 0.05
    view = w.reshape(1, -1) if strategy == "tensor" else w
    scale, zero = calculate_qparams(view.amin(-1), view.amax(-1), args)
    shape = (1,) if strategy == "tensor" else (N, 1)
    scale, zero = scale.reshape(shape), zero.reshape(shape)
    stored = ct.FloatQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme
    )
    assert stored["weight"].dtype == torch.float8_e4m3fn
    parsed = parse_config(config(strategy))
    assert parsed == (TENSOR if strategy == "tensor" else CHANNEL)
    reference = dequantize(stored["weight"], stored["weight_scale"], None, dtype=torch.float32)
    ours = wna16_linear(parsed, stored)
    assert torch.equal(ours.dequantize(), reference)
    assert ours.format == f"c-t fp8 8-bit per-{strategy} sym"
    assert not ours.int8_fits  # FP8 values are no integer codes


@pytest.mark.skipif(kernels is None, reason="the C++ kernels are not built")
@pytest.mark.parametrize("path", PATHS)
def test_every_path_gives_the_generic_paths_bits_batch_invariantly(path):
    scale = torch.rand(N, 1, generator=torch.Generator().manual_seed(4)).bfloat16() * 0.01
    w = wna16_linear(CHANNEL, {"weight": every_code(), "weight_scale": scale})
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(5))
    generic = kernels.linear_group_quant(x, *w.kernel_args(), kernel="generic")
    together = kernels.linear_group_quant(x, *w.kernel_args(), kernel=path)
    assert torch.equal(together, generic)
    for m in (1, 2, 3, 5):
        alone = kernels.linear_group_quant(x[:m], *w.kernel_args(), kernel=path)
        assert torch.equal(alone, together[:m])
    dense = w.dequantize().double()
    assert torch.equal(w.dequantize(), every_code().float() * scale.float())
    exact = x.double() @ dense.T
    assert ((together.double() - exact).abs() <= 1e-5 * (x.double().abs() @ dense.abs().T)).all()
    with pytest.raises(RuntimeError, match="int8 activations need"):
        kernels.linear_group_quant(x, *w.kernel_args(), kernel="int8")


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"weight_scale": torch.ones(N, 1)}, "missing weight"),
        ({"weight": every_code()}, "missing weight_scale"),
        ({"weight": every_code(), "weight_scale": torch.ones(N, 2)}, r"expected 48 \(one per row"),
        ({"weight": every_code().float(), "weight_scale": torch.ones(N, 1)}, "float8_e4m3fn"),
        ({"weight": every_code(N, 48), "weight_scale": torch.ones(N, 1)}, "multiple of 32"),
        (
            {"weight": every_code(), "weight_scale": torch.ones(N, 1, dtype=torch.int8)},
            "float dtype",
        ),
        ({"weight": every_code(), "weight_scale": torch.ones(N, 1), "bias": torch.ones(N)}, "bias"),
        (
            {"weight": torch.full((N, K), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)}
            | {"weight_scale": torch.ones(N, 1)},
            "NaN codes",
        ),
    ],
)
def test_bad_parts_are_refused_by_name(parts, message):
    with pytest.raises(ValueError, match=message):
        unpack_fp8(CHANNEL, parts)


def test_a_per_tensor_config_takes_one_scale():
    with pytest.raises(ValueError, match="expected one per tensor"):
        unpack_fp8(TENSOR, {"weight": every_code(), "weight_scale": torch.ones(N, 1)})
    w = unpack_fp8(TENSOR, {"weight": every_code(), "weight_scale": torch.tensor([0.5])})
    assert torch.equal(w.scales, torch.full((N, K // 32), 0.5))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (config("block", block_structure=[128, 100]), r"block_structure \[128, 100\]"),
        (config("block", block_structure=None), "block_structure None"),
        (config("group", group_size=48), "group_size"),
        (config("tensor_group"), "strategy 'tensor_group'"),
        (config(num_bits=4), "float 4-bit"),
        (config(type="int"), "int 8-bit"),
        (config(symmetric=False), "symmetric"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]"),
        ({"quant_method": "fp8", "weight_block_size": [128, 64.5]}, "weight_block_size"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [1, 32]},
            "static activation scheme",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "per-head"}, "'per-head'"),
    ],
)
def test_unsupported_fp8_configs_are_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_config(raw)


@pytest.mark.parametrize(
    ("strategy", "block", "label"),
    [
        ("group", (1, 64), "c-t fp8 8-bit g64 sym"),
        ("block", (128, 128), "c-t fp8 8-bit block128x128 sym"),
        ("block", (32, 96), "c-t fp8 8-bit block32x96 sym"),  # partial blocks at both ends
    ],
)
def test_group_and_block_scales_unpack_as_compressed_tensors_own_compressor(strategy, block, label):
    ct = pytest.importorskip("compressed_tensors.compressors")
    quantization = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    fields = {"group_size": block[1]} if strategy == "group" else {"block_structure": list(block)}
    args = quantization.QuantizationArgs(num_bits=8, type="float", strategy=strategy, **fields)
    scheme = quantization.QuantizationScheme(targets=["Linear"], weights=args)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(6)) * 0.05
    values, scale = fp8_quantize(w, *block)
    stored = ct.FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert torch.equal(stored["weight"].view(torch.uint8), values.view(torch.uint8))
    parsed = parse_config(config(strategy, **fields))
    reference = dequantize(stored["weight"], scale.float(), None, args=args, dtype=torch.float32)
    ours = wna16_linear(parsed, stored)
    assert torch.equal(ours.dequantize(), reference)
    assert ours.format == label


@pytest.mark.parametrize("block", [(128, 128), (32, 96)])
def test_vllm_fp8_block_scales_unpack_as_the_reference_block_dequantizer(block):
    reference = pytest.importorskip(
        "compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer"
    )
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(7)) * 0.05
    values, scale_inv = fp8_quantize(w, *block, dtype=torch.float32)
    reader = reference.FP8BlockDequantizer(weight_block_size=block, dtype=torch.float32)
    dequantized = reader._create_dequantized_weight(values, scale_inv)
    raw = Scheme(QuantFormat.FP8_VLLM, 8, 0, True, strategy="block", block=block).config()
    parsed = parse_config(raw)
    ours = wna16_linear(parsed, {"weight": values, "weight_scale_inv": scale_inv})
    assert torch.equal(ours.dequantize(), dequantized)
    assert ours.format == f"fp8 8-bit block{block[0]}x{block[1]} sym"
    e8m0 = torch.exp2(torch.log2(scale_inv).round()).to(torch.float8_e8m0fnu)  # DeepSeek's ue8m0
    ours = wna16_linear(parsed, {"weight": values, "weight_scale_inv": e8m0})
    assert torch.equal(ours.dequantize(), values.float() * spread(e8m0, *block, N, K))


def test_vllm_fp8_per_tensor_takes_its_0_d_scale_and_reads_past_the_input_scale():
    parsed = parse_config(Scheme(QuantFormat.FP8_VLLM, 8, 0, True, strategy="tensor").config())
    assert parsed.per_tensor and parsed.marker == "weight_scale"
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(8)) * 0.05
    parts = Scheme(QuantFormat.FP8_VLLM, 8, 0, True, strategy="tensor").fp8_parts(w)
    assert parts["weight_scale"].dim() == 0 and "input_scale" in parts
    ours = wna16_linear(parsed, parts)
    assert torch.equal(ours.dequantize(), parts["weight"].float() * parts["weight_scale"].float())
    assert ours.format == "fp8 8-bit per-tensor sym"


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"weight": every_code(), "weight_scale": torch.ones(1, 2)}, "missing weight_scale_inv"),
        (
            {"weight": every_code(), "weight_scale_inv": torch.ones(2, 2)},
            r"weight_scale_inv is \(2, 2\), expected \(1, 2\) \(one per block of 128 x 128\)",
        ),
        ({"weight": every_code(), "weight_scale_inv": torch.ones(2)}, r"expected \(1, 2\)"),
        (
            {"weight": every_code(), "weight_scale_inv": torch.tensor([[1.0, float("inf")]])},
            "weight_scale_inv holds scales that are not finite",
        ),
    ],
)
def test_bad_block_scales_are_refused_by_name(parts, message):
    with pytest.raises(ValueError, match=message):
        unpack_fp8(VLLM_BLOCKS, parts)


@pytest.mark.skipif(kernels is None, reason="the C++ kernels are not built")
@pytest.mark.parametrize("path", PATHS)
def test_block_scales_and_daz_keep_the_generic_paths_bits(path):
    """Scales that change every 32 columns take the same bits on every path; so does a thread
    whose MXCSR has denormals-are-zero set (subnormal FP8 codes stay exact)."""
    scale_inv = torch.rand(1, 8, generator=torch.Generator().manual_seed(9)) * 0.01
    config = Wna16Config(QuantFormat.FP8_VLLM, 8, 32, True, block_rows=N)
    w = wna16_linear(config, {"weight": every_code(), "weight_scale_inv": scale_inv})
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(10))
    generic = kernels.linear_group_quant(x, *w.kernel_args(), kernel="generic")
    assert torch.equal(kernels.linear_group_quant(x, *w.kernel_args(), kernel=path), generic)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on this thread, whose MXCSR set_flush_denormal sets
    try:
        assert torch.set_flush_denormal(True)
        for m in (1, 5):
            flushed = kernels.linear_group_quant(x[:m], *w.kernel_args(), kernel=path)
            assert torch.equal(flushed, generic[:m])
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
