"""AWQ, GPTQ and compressed-tensors (pack-quantized; int-quantized W8A8) weights -> integer
codes and group scales.

The three formats store one idea, w[n, k] = (q[n, k] - z[n, g]) * s[n, g] with g column k's
group, packed into int32 words three ways (read from the formats' own code: AutoAWQ's GEMM
pack as vLLM's awq_triton dequantizes it, AutoGPTQ's QuantLinear, compressed-tensors'
pack_to_int32):

    format      codes                         zero points                 scales
    AWQ GEMM    qweight [K, N/8] along N,     qzeros [K/G, N/8], packed   scales [K/G, N]
                nibbles of 0 2 4 6 1 3 5 7    as qweight
    GPTQ        qweight [K/pf, N] along K     qzeros [K/G, N/pf] along N  scales [K/G, N]
                (pf = 32 / bits)              (format v1: z = stored + 1)
    c-t pack    weight_packed [N, K/pf]       weight_zero_point           weight_scale
                along K                       [N/pf, K/G] along N         [N, K/G]
    c-t int     weight [N, K] int8 (signed)   weight_zero_point           weight_scale
                                              [N, K/G] int8               [N, K/G]; [1]: tensor

Within a word, code j sits at bits * j. GPTQ's `g_idx` [K] (compressed-tensors'
`weight_g_idx`) names each column's group, which under act order is not k / G. A symmetric
checkpoint has z = 2^(bits - 1) (GPTQ's stored zeros are then ignored, as vLLM does;
compressed-tensors stores its codes signed, i.e. minus that midpoint, which is the same).
An int-quantized (W8A8) checkpoint's activation scheme (int8 per token, or a static
input_scale) is not read: activations are as --group-quant-activations says.

The one subtle rule: codes stay unsigned integers and zero points one integer per group, so
(q - z) * s is exact in fp32 (a 9-bit integer times an fp16 or bf16 scale); whatever
computes the weights later (model/wna16_linear.py) gets exactly the format's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shared.models.wna16_config import PARTS, QuantFormat, Wna16Config

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column r of 8 is in nibble AWQ_ORDER[r]


@dataclass(slots=True)
class IntGroups:
    """One [N, K] matrix unpacked: w = (codes - zeros) * scales, per group."""

    codes: torch.Tensor  # [N, K] uint8, unsigned, the checkpoint's column order
    scales: torch.Tensor  # [N, groups] float32: the stored scales exactly
    zeros: torch.Tensor  # [N, groups] int32
    group_of: torch.Tensor | None  # [K] int64: column k's group where not k // (K / groups)


def unpack(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    """A matrix's stored parts (PARTS, by part name) -> IntGroups; ValueError naming the part
    that is missing or of the wrong shape or dtype."""
    required = {
        QuantFormat.AWQ: ("qweight", "scales"),
        QuantFormat.GPTQ: ("qweight", "scales"),
        QuantFormat.COMPRESSED: ("weight_packed", "weight_scale"),
        QuantFormat.INT8: ("weight", "weight_scale"),
    }[config.format]
    if not config.symmetric:
        required += (
            ("qzeros",)
            if config.format in (QuantFormat.AWQ, QuantFormat.GPTQ)
            else ("weight_zero_point",)
        )
    missing = [p for p in required if p not in parts]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    unknown = sorted(set(parts) - set(PARTS[config.format]))
    if unknown:
        raise ValueError(f"unexpected parts {unknown}")
    return _UNPACK[config.format](config, parts)


def _awq(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    qweight, scales = _int32(parts, "qweight"), parts["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = _groups(config, k)
    _shape(scales, "scales", (groups, n))
    codes = _reorder_awq(_words(qweight, 4, dim=1))  # [K, N]
    if config.symmetric:
        zeros = torch.full((groups, n), 8, dtype=torch.int32)
    else:
        qzeros = _int32(parts, "qzeros")
        _shape(qzeros, "qzeros", (groups, n // 8))
        zeros = _reorder_awq(_words(qzeros, 4, dim=1)).to(torch.int32)
    return IntGroups(codes.t().contiguous(), _floats(scales).t().contiguous(), zeros.t(), None)


def _reorder_awq(q: torch.Tensor) -> torch.Tensor:
    """[R, C] codes in AWQ's nibble order -> natural column order."""
    return q.view(q.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(q.shape)


def _gptq(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    bits, per_word = config.bits, 32 // config.bits
    qweight, scales = _int32(parts, "qweight"), parts["scales"]
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    groups = _groups(config, k)
    _shape(scales, "scales", (groups, n))
    codes = _words(qweight, bits, dim=0)  # [K, N]
    if config.symmetric:
        zeros = torch.full((groups, n), 1 << (bits - 1), dtype=torch.int32)
    else:
        qzeros = _int32(parts, "qzeros")
        _shape(qzeros, "qzeros", (groups, n // per_word))
        zeros = _words(qzeros, bits, dim=1).to(torch.int32) + config.zero_offset
    group_of = _group_index(parts.get("g_idx"), "g_idx", k, groups)
    return IntGroups(codes.t().contiguous(), _floats(scales).t().contiguous(), zeros.t(), group_of)


def _compressed(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    bits, per_word = config.bits, 32 // config.bits
    packed, scales = _int32(parts, "weight_packed"), parts["weight_scale"]
    n, k = packed.shape[0], packed.shape[1] * per_word
    if "weight_shape" in parts and [int(v) for v in parts["weight_shape"]] != [n, k]:
        raise ValueError(f"weight_shape {parts['weight_shape'].tolist()}: the codes are {n}x{k}")
    groups = _groups(config, k)
    _shape(scales, "weight_scale", (n, groups))
    codes = _words(packed, bits, dim=1)  # [N, K], stored as the signed code + 2^(bits - 1)
    if config.symmetric:
        zeros = torch.full((n, groups), 1 << (bits - 1), dtype=torch.int32)
    else:
        zero_point = _int32(parts, "weight_zero_point")
        _shape(zero_point, "weight_zero_point", (-(-n // per_word), groups))
        zeros = _words(zero_point, bits, dim=0)[:n].to(torch.int32)  # offset as the codes
    group_of = _group_index(parts.get("weight_g_idx"), "weight_g_idx", k, groups)
    return IntGroups(codes.contiguous(), _floats(scales).contiguous(), zeros, group_of)


def _int8(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> IntGroups:
    weight, scales = parts["weight"], parts["weight_scale"]
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"weight is {tuple(weight.shape)} {weight.dtype}, expected 2-D int8")
    n, k = weight.shape
    groups = _groups(config, k)
    if config.per_tensor:
        if scales.numel() != 1:
            raise ValueError(f"weight_scale is {tuple(scales.shape)}, expected one per tensor")
        scales = scales.reshape(1, 1).expand(n, 1)
    _shape(scales, "weight_scale", (n, groups))
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)  # unsigned, as the other formats'
    if config.symmetric:
        zeros = torch.full((n, groups), 128, dtype=torch.int32)
    else:
        zero_point = parts["weight_zero_point"]
        if zero_point.dtype not in (torch.int8, torch.int32) or zero_point.numel() != n * groups:
            raise ValueError(
                f"weight_zero_point is {tuple(zero_point.shape)} {zero_point.dtype}, expected "
                f"{n * groups} int8"
            )
        zeros = zero_point.to(torch.int32).reshape(n, groups) + 128
    group_of = _group_index(parts.get("weight_g_idx"), "weight_g_idx", k, groups)
    return IntGroups(codes, _floats(scales).contiguous(), zeros, group_of)


_UNPACK = {
    QuantFormat.AWQ: _awq,
    QuantFormat.GPTQ: _gptq,
    QuantFormat.COMPRESSED: _compressed,
    QuantFormat.INT8: _int8,
}


def _words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """[R, C] int32 words -> their codes (code j of a word at bits * j) as uint8, unpacked
    along `dim`: [R, C * 32 / bits] (dim 1) or [R * 32 / bits, C] (dim 0)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)  # [R, C, pf]
    rows, cols = words.shape
    if dim == 1:
        return codes.reshape(rows, -1)
    return codes.permute(0, 2, 1).reshape(-1, cols)


def _groups(config: Wna16Config, k: int) -> int:
    if k % 32 or (config.group and k % config.group):
        raise ValueError(f"{k} input columns are not whole groups of {config.group or 32}")
    return k // config.group if config.group else 1


def _group_index(g_idx: torch.Tensor | None, name: str, k: int, groups: int) -> torch.Tensor | None:
    """g_idx as int64, or None where it is k // (K / groups) (no act order)."""
    if g_idx is None:
        return None
    _shape(g_idx, name, (k,))
    if g_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} is {g_idx.dtype}, expected int32")
    g = g_idx.to(torch.int64)
    if bool(((g < 0) | (g >= groups)).any()):
        raise ValueError(f"{name} names groups outside [0, {groups})")
    return None if torch.equal(g, torch.arange(k) // (k // groups)) else g


def _int32(parts: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    t = parts[name]
    if t.dtype != torch.int32 or t.dim() != 2:
        raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}, expected 2-D int32")
    return t


def _shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} is {tuple(t.shape)}, expected {shape} (wrong group size?)")


def _floats(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"scales are {scales.dtype}, expected a float dtype")
    return scales.to(torch.float32)
