"""AWQ, GPTQ and compressed-tensors matrices (shared/models/wna16.py, model/wna16_linear.py).

Our writer (tests/wna16_writer.py) packs as the formats' reference packers do (vLLM's
awq_pack / gptq_pack / pack_cols, compressed-tensors' pack_to_int32); what it writes, and
what vLLM's own quantizer writes, unpacks into exactly the reference dequantization (vLLM's
unpackers with AWQ's and GPTQ's formulas,
compressed-tensors' unpack_from_int32 and dequantize); the kernel multiplies by those values,
batch-invariantly; bad tensors and configs are refused by name."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.model.wna16_linear import wna16_linear
from shared.models.wna16 import unpack
from shared.models.wna16_config import QuantFormat, Wna16Config, parse_config
from tests.wna16_writer import Scheme, pack, quantize

pytest.importorskip("vllm", reason="vLLM is the reference (make install ENGINE=vllm)")
from vllm.model_executor.layers.quantization.utils import quant_utils
from vllm.scalar_type import scalar_types

N, K = 48, 256
AWQ, GPTQ, CT = QuantFormat.AWQ, QuantFormat.GPTQ, QuantFormat.COMPRESSED
INT8 = QuantFormat.INT8


def weights(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.05 + torch.randn(n, 1, generator=gen) * 0.02


def load(scheme: Scheme, parts: dict[str, torch.Tensor]):
    config = parse_config(scheme.config())
    assert (config.format, config.bits, config.group) == (scheme.format, scheme.bits, scheme.group)
    return wna16_linear(config, parts)


def _awq_unpack(words: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """vLLM's unpack_cols, and the column order its awq_pack interleaves, undone: [rows, cols]."""
    order = quant_utils.unpack_cols(quant_utils.awq_pack(torch.arange(8)[None], 4, 1, 8), 4, 1, 8)
    q = quant_utils.unpack_cols(words, 4, rows, cols)  # nibble i of 8 holds column order[i]
    return q.view(rows, -1, 8)[:, :, torch.argsort(order[0])].reshape(rows, cols)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_unpacks_as_vllms_awq_unpacker_with_awqs_formula(group):
    m = quantize(weights(), 4, group, symmetric=False, act_order=False)
    scheme = Scheme(AWQ, 4, group, symmetric=False)
    parts = scheme.parts(m)
    assert torch.equal(parts["qweight"], quant_utils.awq_pack(m.codes.t(), 4, K, N))
    assert torch.equal(parts["qzeros"], quant_utils.awq_pack(m.zeros.t(), 4, K // group, N))
    q = _awq_unpack(parts["qweight"], K, N)  # [K, N]
    z = _awq_unpack(parts["qzeros"], K // group, N).repeat_interleave(group, dim=0)
    s = parts["scales"].double().repeat_interleave(group, dim=0)
    reference = ((q - z) * s).t().float()  # awq_triton's (iweights - zeros) * scales
    assert torch.equal(load(scheme, parts).dequantize(), reference)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_gptq_unpacks_as_vllms_unpacker_with_gptqs_formula(bits, symmetric, act_order):
    m = quantize(weights(1), bits, 64, symmetric, act_order, seed=3)
    scheme = Scheme(GPTQ, bits, 64, symmetric, act_order)
    parts = scheme.parts(m)
    assert torch.equal(parts["qweight"], quant_utils.gptq_pack(m.codes.t(), bits, K, N))
    kind = scalar_types.uint4 if bits == 4 else scalar_types.uint8
    q = quant_utils.unpack_quantized_values_into_int32(parts["qweight"], kind, packed_dim=0)
    z = quant_utils.unpack_quantized_values_into_int32(parts["qzeros"], kind, packed_dim=1)
    z = torch.full_like(z, 1 << (bits - 1)) if symmetric else z + 1  # format v1: stored z - 1
    g = parts["g_idx"].long()
    reference = ((q - z[g]) * parts["scales"].double()[g]).t().float()  # AutoGPTQ's formula
    w = load(scheme, parts)
    assert (w.in_perm is not None) == act_order
    assert torch.equal(w.dequantize(), reference)
    assert torch.equal(w.dequantize(), m.dequantize())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_gptq_v2_from_vllms_own_quantizer(symmetric):
    """vLLM's quantize_weights (uint4b8: symmetric; uint4 with zero points) and gptq_pack;
    gptq_v2 stores zero points as they are."""
    w = weights(2).t().contiguous().half()  # [K, N], as vLLM's helpers take it
    kind = scalar_types.uint4b8 if symmetric else scalar_types.uint4
    ref, q, s, zp = quant_utils.quantize_weights(w, kind, 64, zero_points=not symmetric)
    parts = {"qweight": quant_utils.gptq_pack(q, 4, K, N), "scales": s}
    if not symmetric:
        parts["qzeros"] = quant_utils.pack_cols(zp, 4, K // 64, N)
    raw = Scheme(GPTQ, 4, 64, symmetric).config() | {"checkpoint_format": "gptq_v2"}
    ours = wna16_linear(parse_config(raw), parts).dequantize()
    assert torch.equal(ours.half(), ref.t())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [128, 0], ids=["g128", "channel"])
def test_compressed_tensors_unpack_as_its_own_dequantize(bits, symmetric, group):
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    m = quantize(weights(4), bits, group, symmetric, act_order=group == 128, seed=5)
    scheme = Scheme(CT, bits, group, symmetric, act_order=group == 128)
    parts = scheme.parts(m)
    signed = (m.codes - (1 << (bits - 1))).to(torch.int8)
    assert torch.equal(parts["weight_packed"], ct.pack_to_int32(signed, bits))
    q = ct.unpack_from_int32(parts["weight_packed"], bits, torch.Size([N, K]))
    zp = None
    if not symmetric:
        zp = ct.unpack_from_int32(
            parts["weight_zero_point"], bits, m.scales.shape, packed_dim=0
        ).float()
    g_idx = parts.get("weight_g_idx")
    scale = parts["weight_scale"].float()
    reference = forward.dequantize(q.float(), scale, zp, g_idx=g_idx, dtype=torch.float32)
    assert torch.equal(load(scheme, parts).dequantize(), reference)


@pytest.mark.parametrize(
    ("strategy", "symmetric"),
    [("channel", True), ("tensor", True), ("group", False), ("channel", False)],
)
def test_int_quantized_unpacks_as_compressed_tensors_own_compressor(strategy, symmetric):
    """W8A8 as compressed-tensors' IntQuantizationCompressor writes it; our unpacking against
    its decompress (the reference dequantization)."""
    ct = pytest.importorskip("compressed_tensors.compressors")
    quantization = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.utils import calculate_qparams

    args = quantization.QuantizationArgs(
        num_bits=8,
        type="int",
        strategy=strategy,
        symmetric=symmetric,
        group_size=64 if strategy == "group" else None,
    )
    tokens = quantization.QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True)
    scheme = quantization.QuantizationScheme(
        targets=["Linear"], weights=args, input_activations=tokens
    )
    w = weights(9)
    view = {"tensor": w.reshape(1, -1), "channel": w, "group": w.reshape(N, K // 64, 64)}[strategy]
    scale, zero = calculate_qparams(view.amin(-1), view.amax(-1), args)
    if strategy == "channel":
        scale, zero = scale.reshape(N, 1), zero.reshape(N, 1)
    scale = scale.bfloat16()  # as llm-compressor stores a bf16 model's (exact: see wna16_linear)
    stored = ct.IntQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme
    )
    assert stored["weight"].dtype == torch.int8
    assert ("weight_zero_point" in stored) == (not symmetric)
    raw = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": scheme.model_dump() | {"format": "int-quantized"}},
    }
    config = parse_config(raw)
    assert (config.format, config.bits, config.per_tensor) == (INT8, 8, strategy == "tensor")
    # its decompress, in fp32 (it rounds to the scale's dtype, bf16, after the one product)
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    zp = stored.get("weight_zero_point")
    reference = forward.dequantize(
        stored["weight"].float(),
        stored["weight_scale"].float(),
        None if zp is None else zp.float(),
        dtype=torch.float32,
    )
    decompressed = ct.IntQuantizationCompressor.decompress(dict(stored), scheme)["weight"]
    assert torch.equal(reference.bfloat16(), decompressed)
    assert torch.equal(wna16_linear(config, stored).dequantize(), reference)


def test_our_packer_matches_compressed_tensors_for_zero_points():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    zeros = torch.randint(0, 16, (N, 4), generator=torch.Generator().manual_seed(6))
    assert torch.equal(pack(zeros, 4, 0), ct.pack_to_int32((zeros - 8).to(torch.int8), 4, 0))


@pytest.mark.skipif(native.load() is None, reason="the kernel needs the C++ kernels")
@pytest.mark.parametrize(
    "scheme",
    [
        Scheme(AWQ, 4, 128, symmetric=False),
        Scheme(GPTQ, 4, 32, symmetric=False, act_order=True),
        Scheme(GPTQ, 8, 0, symmetric=True),
        Scheme(GPTQ, 8, 64, symmetric=False),
        Scheme(CT, 4, 128, symmetric=True, act_order=True),
        Scheme(INT8, 8, 0, symmetric=True),
        Scheme(INT8, 8, 64, symmetric=False, act_order=True),
    ],
    ids=lambda s: parse_config(s.config()).label.replace(" ", "-"),
)
def test_the_kernel_multiplies_by_the_unpacked_weights_batch_invariantly(scheme):
    k = 384  # per channel: 3 super-blocks of 128
    m = quantize(weights(7, k=k), scheme.bits, scheme.group, scheme.symmetric, scheme.act_order)
    w = load(scheme, scheme.parts(m))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(8))
    y = w(x)
    exact = x.double() @ w.dequantize().double().t()
    bound = 1e-5 * (x.abs().double() @ w.dequantize().abs().double().t()) + 1e-7
    assert bool(((y.double() - exact).abs() <= bound).all())
    for i in (0, 4, 8):
        assert torch.equal(w(x[i : i + 1]), y[i : i + 1])
    assert torch.equal(w(x[2:7]), y[2:7])


def _with_weights(scheme: Scheme, **change) -> dict:
    raw = scheme.config()
    raw["config_groups"]["group_0"]["weights"] |= change
    return raw


def _with_activations(scheme: Scheme, **change) -> dict:
    raw = scheme.config()
    raw["config_groups"]["group_0"]["input_activations"] |= change
    return raw


def _parts(scheme: Scheme) -> dict[str, torch.Tensor]:
    m = quantize(weights(), scheme.bits, scheme.group, scheme.symmetric, scheme.act_order)
    return scheme.parts(m)


@pytest.mark.parametrize(
    ("scheme", "change", "message"),
    [
        (
            Scheme(AWQ, 4, 128, False),
            {"group_size": 64},
            r"scales is \(2, 48\), expected \(4, 48\)",
        ),
        (
            Scheme(GPTQ, 4, 64, False),
            {"group_size": 128},
            r"scales is \(4, 48\), expected \(2, 48\)",
        ),
        (Scheme(CT, 4, 128, True), {"format": "int-quantized"}, "format 'int-quantized'"),
    ],
)
def test_a_config_that_does_not_fit_the_tensors_is_refused_by_name(scheme, change, message):
    parts = _parts(scheme)
    raw = scheme.config()
    if scheme.format == CT:
        raw["config_groups"]["group_0"]["format"] = change["format"]
        with pytest.raises(ValueError, match=message):
            parse_config(raw)
        return
    with pytest.raises(ValueError, match=message):
        wna16_linear(parse_config(raw | change), parts)


@pytest.mark.parametrize(
    ("scheme", "drop", "message"),
    [
        (Scheme(AWQ, 4, 128, False), "scales", "missing scales"),
        (Scheme(AWQ, 4, 128, False), "qzeros", "missing qzeros"),
        (Scheme(GPTQ, 4, 64, False), "qzeros", "missing qzeros"),
        (Scheme(CT, 4, 128, False), "weight_zero_point", "missing weight_zero_point"),
        (Scheme(CT, 4, 128, True), "weight_scale", "missing weight_scale"),
        (Scheme(INT8, 8, 0, True), "weight_scale", "missing weight_scale"),
        (Scheme(INT8, 8, 64, False), "weight_zero_point", "missing weight_zero_point"),
    ],
)
def test_a_missing_part_is_refused_by_name(scheme, drop, message):
    parts = _parts(scheme)
    del parts[drop]
    with pytest.raises(ValueError, match=message):
        wna16_linear(parse_config(scheme.config()), parts)


def test_bad_shapes_and_dtypes_are_refused_by_name():
    config = parse_config(Scheme(GPTQ, 4, 64, False).config())
    parts = _parts(Scheme(GPTQ, 4, 64, False))
    with pytest.raises(ValueError, match=r"qzeros is \(4, 5\), expected \(4, 6\)"):
        unpack(config, parts | {"qzeros": parts["qzeros"][:, :5]})
    with pytest.raises(ValueError, match=r"qweight is .* torch.int64, expected 2-D int32"):
        unpack(config, parts | {"qweight": parts["qweight"].long()})
    with pytest.raises(ValueError, match="g_idx names groups outside"):
        unpack(config, parts | {"g_idx": parts["g_idx"] + 4})
    with pytest.raises(ValueError, match="unexpected parts"):
        unpack(config, parts | {"bias_q": parts["scales"]})
    int8 = parse_config(Scheme(INT8, 8, 0, True).config())
    stored = _parts(Scheme(INT8, 8, 0, True))
    with pytest.raises(ValueError, match=r"weight is \(48, 256\) torch.int32, expected 2-D int8"):
        unpack(int8, stored | {"weight": stored["weight"].int()})
    with pytest.raises(ValueError, match=r"weight_scale is \(48, 2\), expected \(48, 1\)"):
        unpack(int8, stored | {"weight_scale": stored["weight_scale"].repeat(1, 2)})
    tensor = parse_config(_with_weights(Scheme(INT8, 8, 0, True), strategy="tensor"))
    with pytest.raises(ValueError, match=r"weight_scale is \(48, 1\), expected one per tensor"):
        unpack(tensor, stored)
    uneven = parts["g_idx"].clone()
    uneven[-3:] = 0
    with pytest.raises(ValueError, match="g_idx does not split the 256 columns into groups"):
        wna16_linear(config, parts | {"g_idx": uneven})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group size 48"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        (_with_weights(Scheme(INT8, 8, 0, True), type="float"), "'int-quantized' with float"),
        (_with_weights(Scheme(INT8, 8, 0, True), num_bits=4), "'int-quantized' with int"),
        (_with_weights(Scheme(INT8, 8, 0, True), strategy="block"), "strategy 'block'"),
        (_with_activations(Scheme(INT8, 8, 0, True), type="float"), "activations {'num_bits'"),
    ],
)
def test_unsupported_configs_are_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_config(raw)


def test_labels_name_format_bits_and_group():
    assert Wna16Config(AWQ, 4, 128, False).label == "AWQ 4-bit g128"
    assert Wna16Config(GPTQ, 8, 0, True, 1).label == "GPTQ 8-bit per-channel sym"
    assert Wna16Config(INT8, 8, 0, True, per_tensor=True).label == "c-t int 8-bit per-tensor sym"
