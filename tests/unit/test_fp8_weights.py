"""compressed-tensors float-quantized (FP8 E4M3) weights: read as its own compressor writes
them (per channel and per tensor), their weights its dequantize's in fp32 exactly; the
group-quant kernel's FP8 path gives the same bits on its generic, AVX-512 and AVX2 paths,
batch-invariantly, within fp32 rounding of the dequantized product; refusals by name."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.model.wna16_linear import wna16_linear
from shared.models.fp8_weights import unpack_fp8
from shared.models.wna16_config import QuantFormat, Wna16Config, parse_config
from tests.wna16_writer import Scheme

kernels = native.load()
N, K = 48, 256
CHANNEL = Wna16Config(QuantFormat.FP8, 8, 0, True)
TENSOR = Wna16Config(QuantFormat.FP8, 8, 0, True, per_tensor=True)
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
    assert torch.equal(w.scales, torch.full((N,), 0.5))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (config("block", block_structure=[128, 128]), "strategy 'block'"),
        (config("group", group_size=128), "strategy 'group'"),
        (config(num_bits=4), "float 4-bit"),
        (config(type="int"), "int 8-bit"),
        (config(symmetric=False), "symmetric"),
    ],
)
def test_unsupported_fp8_configs_are_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_config(raw)
