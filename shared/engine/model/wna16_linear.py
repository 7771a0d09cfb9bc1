"""AWQ / GPTQ / compressed-tensors matrices (shared/models/wna16.py, fp8_weights.py) -> a
`GroupQuantLinear`.

The group-quant kernel's layout (model/group_quant.py) takes them as they are, integers
kept: groups of 32 columns under a super-block factor per G columns (per_super = G / 32,
G cut down to 32 times a power of 2 where it is not one, its scales repeated), and

    4-bit: code q as stored, layout zero 8;     8-bit: code q - 128 (int8), layout zero 0
    scale = s (super_scale; no group factor)
    min   = s * (2^(bits-1) - z)  (super_min = ±s, sub_min = ±(2^(bits-1) - z) int8 per 32)

so w = (q - 8) * s + s * (8 - z) = (q - z) * s, with every term exact in fp32 (the kernel's
one rounding is of an exactly representable value: the format's own weights bit for bit)
where s has at most 15 significant bits (fp16, bf16 scales, as the formats store them); an
fp32 scale with zero points rounds its two terms apart (within an ulp of the format's).
A symmetric matrix (every z at the midpoint) has no min at all. Act order (GPTQ's g_idx):
the columns are stored sorted by group and `in_perm` gathers x's columns to match.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shared.engine.model.group_quant import GroupQuantLinear
from shared.models.fp8_weights import Fp8Weights, unpack_fp8
from shared.models.wna16 import IntGroups, unpack
from shared.models.wna16_config import FP8_FORMATS, Wna16Config


def wna16_linear(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> GroupQuantLinear:
    """A matrix's stored parts -> the kernel's layout; ValueError naming what is wrong."""
    if config.format in FP8_FORMATS:
        return from_fp8(unpack_fp8(config, parts), config.label)
    return from_int_groups(unpack(config, parts), config.bits, config.label)


def from_fp8(m: Fp8Weights, label: str) -> GroupQuantLinear:
    """FP8 values as 8-bit codes of the float8 dtype (the kernel reads them as FP8), the scale
    of each row and 32 columns as its super_scale: w = value * scale (+ 0)."""
    n, k = m.values.shape
    return GroupQuantLinear(
        format=label,
        out_features=n,
        in_features=k,
        bits=8,
        group=32,
        per_super=1,
        zero=0,
        super_scale=m.scales,
        codes=m.values,
    )


def from_int_groups(m: IntGroups, bits: int, label: str) -> GroupQuantLinear:
    codes, scales, zeros = m.codes, m.scales, m.zeros
    n, k = codes.shape
    size = k // scales.shape[1]  # columns per group
    in_perm = None
    if m.group_of is not None:
        in_perm = torch.sort(m.group_of, stable=True).indices
        if not torch.equal(m.group_of[in_perm], torch.arange(k) // size):
            raise ValueError(f"g_idx does not split the {k} columns into groups of {size}")
        codes = codes[:, in_perm]
    per_super = (size // 32) & -(size // 32)  # the largest power of 2 dividing size / 32
    scales = scales.repeat_interleave(size // (32 * per_super), dim=1)
    mid = 1 << (bits - 1)
    offsets = (mid - zeros).repeat_interleave(size // 32, dim=1)  # [N, K / 32]
    if bool(((zeros < 0) | (zeros > 2 * mid)).any()):
        raise ValueError(f"zero points outside [0, {2 * mid}]")
    sign = 1 if int(offsets.max()) <= 127 else -1
    if int((offsets * sign).min()) < -128:
        raise ValueError("zero points span more than an int8 offset from the midpoint")
    mins = {}
    if bool(offsets.any()):
        mins = {"super_min": scales * sign, "sub_min": (offsets * sign).to(torch.int8)}
    if bits == 8:
        packed = {"codes": (codes.to(torch.int16) - mid).to(torch.int8).contiguous()}
    else:
        halves = codes.view(n, k // 32, 2, 16)  # per 32 columns: j and j + 16 share byte j
        packed = {"low": (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)}
    return GroupQuantLinear(
        format=label,
        out_features=n,
        in_features=k,
        bits=bits,
        group=32,
        per_super=per_super,
        zero=mid if bits == 4 else 0,
        super_scale=scales.contiguous(),
        in_perm=in_perm,
        **{name: t.contiguous() for name, t in (packed | mins).items()},
    )
