"""Which kept-quantized matrices the int8 kernel takes repacked into panels of 16 columns, and
the repack: the k-quants Q2_K-Q6_K (csrc/cpu/linear_kquant_panels.cpp) and the one-group
formats Q4_0-Q8_0 (linear_block_panels.cpp), as kernel "int8-amx" where `panels` is "amx" (the
CPU's AMX tiles run) or "int8-panels" where it is "vnni" (an AVX512-VNNI build without them:
the same bits by VNNI alone). The one rule: a repack permutes a matrix's codes and factors and
keeps every byte (resident weights do not grow), and a repacked matrix no longer reads as the
stored layout."""

from __future__ import annotations

from typing import Protocol

import torch

from shared.engine import native


class KeptMatrix(Protocol):
    """What the choice and the repack read of a kept matrix (model/group_quant.py's
    GroupQuantLinear; its parts by name as well)."""

    bits: int
    group: int
    per_super: int
    zero: int
    out_features: int
    sub_scale: torch.Tensor | None
    sub_min: torch.Tensor | None
    in_perm: torch.Tensor | None

    @property
    def int8_fits(self) -> bool: ...


KERNELS = {"amx": "int8-amx", "vnni": "int8-panels"}
# repack_kquant_amx's parts in order, and repack_block_panels's outputs after its first
_KQUANT_PARTS = ("low", "high", "super_scale", "sub_scale", "super_min", "sub_min")


def one_group(w: KeptMatrix) -> bool:
    """A factor (and a min) per block of 32, 4, 5 or 8 bits a code (8-bit: zero 0, as the
    tiles read the signed codes): Q4_0 ... Q8_0, and AWQ / GPTQ symmetric in groups of 32."""
    blocks = w.per_super == 1 and w.group == 32 and w.sub_scale is None and w.sub_min is None
    return blocks and (w.bits in (4, 5) or (w.bits == 8 and w.zero == 0))


def kquant(w: KeptMatrix) -> bool:
    """The k-quants' shapes the panels take: super-blocks of 256 with group scales, 4-6 bit
    codes in groups of 32, or 4 or 6 in groups of 16."""
    shape = (w.group == 32 and 4 <= w.bits <= 6) or (w.group == 16 and w.bits in (4, 6))
    return shape and w.group * w.per_super == 256 and w.sub_scale is not None


def panel_kernel(w: KeptMatrix, panels: str | None) -> str | None:
    """The panel kernel that takes `w` where `panels` ("amx", "vnni" or None) run, else None."""
    whole = w.int8_fits and w.in_perm is None and w.out_features % 16 == 0
    takes = one_group(w) or kquant(w)
    return KERNELS[panels] if panels in KERNELS and whole and takes else None


def repacked(w: KeptMatrix) -> dict[str, torch.Tensor]:
    """`w`'s present parts repacked into panels, by name."""
    kernels, empty = native.load(), torch.empty(0)

    def part(name: str) -> torch.Tensor:
        t = getattr(w, name)
        return empty if t is None else t

    if one_group(w):
        names = ("codes" if w.bits == 8 else "low", *_KQUANT_PARTS[1:])
        parts = [part(n) for n in ("codes", "low", "high", "super_scale", "super_min")]
        packed = kernels.repack_block_panels(*parts, w.bits)
    else:
        names = _KQUANT_PARTS
        packed = kernels.repack_kquant_amx(*map(part, names), w.bits, w.group, w.zero)
    return {n: t for n, t in zip(names, packed, strict=True) if getattr(w, n) is not None}
