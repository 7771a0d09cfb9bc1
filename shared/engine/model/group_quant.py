"""Group-quantized matrices as a checkpoint ships them (GGUF Q4_0 ... Q6_K), kept quantized.

The layout is shared/models/gguf_quant.py's (`pull` writes it): per weight a code of 4, 5, 6
or 8 bits, per group of 16 or 32 weights a scale and a min made of an fp32 super-block factor
times an int8 group factor, w = (q - zero) * scale + min. `GroupQuantLinear(x)` runs the C++
kernel (csrc/cpu/linear_group_quant.cpp), which dequantizes 16 weights at a time in registers
with that same arithmetic, so it multiplies by exactly `dequantize()`'s values; each output is
one k-ordered chain of fma in 16 lanes and a fixed lane sum, whatever the number of rows,
which makes it batch-invariant (on a CPU without AVX-512 its AVX2 path, and without AVX2 its
generic one, give the same bits). Without the kernels the matrix is dequantized per call. With
`kernel="int8"` (`with_int8_activations`, --group-quant-activations int8) the kernel quantizes
each row of x to int8 per block and sums integer products instead (AVX512-VNNI or AVX2,
csrc/cpu/linear_group_quant_int8.cpp): faster decoding, not the exact weights' sums, still
batch-invariant. Where the CPU has AMX and the OS grants the tiles, the k-quants (Q4_K, Q5_K,
Q6_K) and the one-group formats (Q4_0 ... Q8_0) take `kernel="int8-amx"` instead: their codes
and factors permuted into panels of 16 columns (`repack_kquant_amx`, `repack_block_panels`:
the same bytes), multiplied on AMX-INT8 tiles (csrc/cpu/linear_kquant_panels.cpp,
linear_block_panels.cpp) for every row count; on other AVX512-VNNI builds they take the same
panels by VNNI alone (`kernel="int8-panels"`, the same bits). Such a matrix
no longer reads as the stored layout (`codes_of_rows`, `take_rows` refuse it).

A matrix whose rows came from tensors of different formats (a fused qkv whose v is Q6_K and
q, k Q5_0) is a `GroupQuantParts`: its parts' outputs side by side. A matrix stored with its
columns permuted (GPTQ's act order, model/wna16_linear.py) has `in_perm`: the kernel takes x's
columns gathered by it, and `dequantize` gives the matrix in its own column order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shared.engine import native
from shared.engine.model.group_quant_panels import KERNELS, panel_kernel, repacked

ARRAY_NAMES = ("codes", "low", "high", "super_scale", "sub_scale", "super_min", "sub_min")
_PARAMS = ("format", "bits", "group", "per_super", "zero")


@dataclass(slots=True, frozen=True)
class GroupQuantLinear:
    format: str  # the checkpoint's own name for it ("Q4_K"), for the log
    out_features: int
    in_features: int
    bits: int  # 4, 5, 6 or 8
    group: int  # weights per scale: 16 or 32
    per_super: int  # groups per super-block factor
    zero: int  # subtracted from every code
    super_scale: torch.Tensor  # [N, K / (group * per_super)] float32
    codes: torch.Tensor | None = None  # [N, K] int8 (bits 8), or float8_e4m3fn values (FP8)
    low: torch.Tensor | None = None  # [N, K / 2] uint8: per 32 weights j | j + 16 << 4
    high: torch.Tensor | None = None  # [N, bits - 4, K / 8] uint8 bit planes
    sub_scale: torch.Tensor | None = None  # [N, K / group] int8; None: 1
    super_min: torch.Tensor | None = None  # [N, K / (group * per_super)] float32; None: 0
    sub_min: torch.Tensor | None = None  # [N, K / group] int8; None: 1
    in_perm: torch.Tensor | None = None  # [K] int64: stored column i is column in_perm[i]
    kernel: str = "auto"  # linear_group_quant's: auto | avx2 | generic | int8 | int8-avx2 |
    # int8-generic | int8-amx | int8-panels

    @classmethod
    def from_tensors(cls, params: dict[str, int | str], arrays: dict[str, torch.Tensor]):
        """From a checkpoint's tensors (`ARRAY_NAMES`) and parameters; checks their shapes
        against each other, so a file with a missing or mis-sized part is refused by name."""
        listed = set(str(params.get("parts", "")).split(",")) - {""}
        missing = sorted(listed - set(arrays)) + sorted(set(_PARAMS) - set(params))
        unknown = sorted(set(arrays) - listed - set(ARRAY_NAMES))
        if missing or unknown or "super_scale" not in arrays:
            raise ValueError(f"missing parts {missing or ['super_scale']}, unknown {unknown}")
        n = arrays["super_scale"].shape[0]
        bits, group, per_super = int(params["bits"]), int(params["group"]), int(params["per_super"])
        k = arrays["codes"].shape[1] if bits == 8 and "codes" in arrays else None
        if k is None and "low" in arrays:
            k = arrays["low"].shape[1] * 2
        if k is None:
            raise ValueError(f"no codes for {bits}-bit weights")
        want = {
            "super_scale": ((n, k // (group * per_super)), torch.float32),
            "sub_scale": ((n, k // group), torch.int8),
            "super_min": ((n, k // (group * per_super)), torch.float32),
            "sub_min": ((n, k // group), torch.int8),
        }
        if bits == 8:
            want["codes"] = ((n, k), torch.int8)
        else:
            want["low"] = ((n, k // 2), torch.uint8)
            if bits > 4:
                want["high"] = ((n, bits - 4, k // 8), torch.uint8)
        required = {"super_scale", "codes", "low", "high"} & set(want)
        missing = sorted(required - set(arrays))
        extra = sorted(set(arrays) - set(want))
        if bits not in (4, 5, 6, 8) or group not in (16, 32) or k % 32 or missing or extra:
            raise ValueError(
                f"not a {bits}-bit group-{group} layout of {k} columns "
                f"(missing {missing}, unexpected {extra})"
            )
        if per_super != 1 and "sub_scale" not in arrays:
            raise ValueError("super-blocks without their group scales (sub_scale)")
        for name, tensor in arrays.items():
            shape, dtype = want[name]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{name} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}"
                )
        return cls(
            format=str(params["format"]),
            out_features=n,
            in_features=k,
            bits=bits,
            group=group,
            per_super=per_super,
            zero=int(params["zero"]),
            **{name: t.contiguous() for name, t in arrays.items()},
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.super_scale.device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, name) for name in ARRAY_NAMES) if t is not None]

    @property
    def in_panels(self) -> bool:
        """Whether the codes and factors are repacked into panels (`with_int8_activations`)."""
        return self.kernel in KERNELS.values()

    def _stored_layout(self) -> None:
        if self.in_panels:
            raise ValueError(f"this {self.format} matrix is in panels, not the stored layout")

    def take_rows(self, rows: torch.Tensor) -> GroupQuantLinear:
        """The matrix of rows `rows` [R] int64 (a permutation or a selection)."""
        self._stored_layout()
        picked = {
            name: getattr(self, name)[rows].contiguous()
            for name in ARRAY_NAMES
            if getattr(self, name) is not None
        }
        return replace(self, out_features=rows.shape[0], **picked)

    def stacks_with(self, other: GroupQuantLinear) -> bool:
        """Whether `other`'s rows can join this matrix's (the same layout and columns)."""
        same = [getattr(self, n) == getattr(other, n) for n in (*_PARAMS, "in_features")]
        present = [(getattr(self, n) is None) == (getattr(other, n) is None) for n in ARRAY_NAMES]
        a, b = self.in_perm, other.in_perm
        perm = a is b or (a is not None and b is not None and torch.equal(a, b))
        stored = not (self.in_panels or other.in_panels)
        return all(same) and all(present) and perm and stored

    def codes_of_rows(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[R, K] int32: q - zero of the rows `rows` (None: all), in the stored column order
        (FP8: the values, float32)."""
        self._stored_layout()
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        if self.bits == 8 and self.codes.dtype == torch.float8_e4m3fn:
            return pick(self.codes).float()
        if self.bits == 8:
            q = pick(self.codes).to(torch.int32)
        else:
            low = pick(self.low).view(-1, self.in_features // 32, 1, 16).to(torch.int32)
            q = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(-1, self.in_features)
            if self.high is not None:
                planes = pick(self.high)  # [R, P, K / 8]
                for p in range(planes.shape[1]):
                    bytes_ = planes[:, p].to(torch.int32).unsqueeze(-1)  # [R, K / 8, 1]
                    bits = (bytes_ >> torch.arange(8, dtype=torch.int32)) & 1
                    q = q | (bits.reshape(q.shape) << (4 + p))
        return q - self.zero

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[R, K] float32 (rows `rows`, None: all): (q - zero) * scale + min, per group."""
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        q = self.codes_of_rows(rows).float()
        r = q.shape[0]
        scale = pick(self.super_scale).repeat_interleave(self.per_super, dim=1)
        if self.sub_scale is not None:
            scale = scale * pick(self.sub_scale).float()
        q = q.view(r, -1, self.group) * scale.unsqueeze(-1)
        if self.super_min is not None:
            low = pick(self.super_min).repeat_interleave(self.per_super, dim=1)
            if self.sub_min is not None:
                low = low * pick(self.sub_min).float()
            q = q + low.unsqueeze(-1)
        stored = q.reshape(r, self.in_features)
        if self.in_perm is None:
            return stored
        return torch.empty_like(stored).index_copy_(1, self.in_perm, stored)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] fp32 or bf16 -> [T, N] fp32 (the kernel's) or x's dtype (the fallback)."""
        kernels = native.load()
        if kernels is None or x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.dequantize().to(x.device, x.dtype))
        if self.in_perm is not None:
            x = x.index_select(1, self.in_perm)
        return kernels.linear_group_quant(x, *self.kernel_args(), self.kernel)

    @property
    def int8_fits(self) -> bool:
        """Whether the int8-activation kernel takes this layout (linear_group_quant_int8.cpp's
        int8_fits: whole pairs of 32-blocks, super-blocks of whole pairs or single groups;
        group scales within super-blocks only as the k-quants have them, 4-6 bits a code,
        super-blocks of 256, mins with a factor per group)."""
        if self.codes is not None and self.codes.dtype != torch.int8:
            return False  # FP8 values: no integer codes to dot
        span = self.group * self.per_super
        blocks = self.group == 32 if self.per_super == 1 else span % 64 == 0
        kquant = (
            self.bits < 8 and span == 256 and (self.super_min is None or self.sub_min is not None)
        )
        scales = self.sub_scale is None or self.per_super == 1 or kquant
        return self.in_features % 64 == 0 and blocks and scales

    def with_int8_activations(self, vector: bool, panels: str | None = None) -> GroupQuantLinear:
        """The same matrix through the int8-activation kernel where it fits (vector: its
        AVX512-VNNI or AVX2 path, the build's; else its generic model: the same bits, slowly),
        repacked into panels of 16 columns where `panels` ("amx", "vnni") takes it
        (model/group_quant_panels.py)."""
        if not self.int8_fits:
            return self
        kernel = panel_kernel(self, panels)
        if kernel is None:
            return replace(self, kernel="int8" if vector else "int8-generic")
        return replace(self, kernel=kernel, **repacked(self))

    def kernel_args(self) -> tuple:
        """linear_group_quant's arguments after x (an absent part: an empty tensor)."""
        empty = torch.empty(0)
        return (
            self.codes if self.codes is not None else empty,
            self.low if self.low is not None else empty,
            self.high if self.high is not None else empty,
            self.super_scale,
            self.sub_scale if self.sub_scale is not None else empty,
            self.super_min if self.super_min is not None else empty,
            self.sub_min if self.sub_min is not None else empty,
            self.bits,
            self.group,
            self.per_super,
            self.zero,
            self.out_features,
        )


@dataclass(slots=True, frozen=True)
class GroupQuantParts:
    """Row blocks of different layouts, one matrix: outputs side by side, in order. A float
    block (a GGUF tensor stored F16/F32 beside quantized ones) runs through torch's matmul."""

    parts: tuple[GroupQuantLinear | torch.Tensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def format(self) -> str:
        return "+".join(
            p.format if isinstance(p, GroupQuantLinear) else "float" for p in self.parts
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in (p.tensors() if _quant(p) else [p])]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() if _quant(p) else p.float() for p in self.parts])

    def with_int8_activations(self, vector: bool, panels: str | None = None) -> GroupQuantParts:
        return GroupQuantParts(
            tuple(p.with_int8_activations(vector, panels) if _quant(p) else p for p in self.parts)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [
            p(x) if _quant(p) else torch.nn.functional.linear(x.to(p.dtype), p) for p in self.parts
        ]
        return torch.cat([y.to(outs[0].dtype) for y in outs], dim=1)


def _quant(part: GroupQuantLinear | torch.Tensor) -> bool:
    return isinstance(part, GroupQuantLinear)


GroupQuant = GroupQuantLinear | GroupQuantParts


def stack_rows(blocks: list[torch.Tensor | GroupQuant]) -> torch.Tensor | GroupQuant:
    """Row blocks -> one matrix: float ones concatenated, quantized ones stacked where their
    layouts agree, else kept as parts."""
    if all(isinstance(b, torch.Tensor) for b in blocks):
        return torch.cat(blocks)  # type: ignore[arg-type]
    parts: list[GroupQuantLinear | torch.Tensor] = []
    for block in blocks:
        for part in block.parts if isinstance(block, GroupQuantParts) else (block,):
            last = parts[-1] if parts else None
            if _quant(part) and isinstance(last, GroupQuantLinear) and last.stacks_with(part):
                parts[-1] = _cat(last, part)
            elif isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor):
                parts[-1] = torch.cat([last, part])
            else:
                parts.append(part)
    return parts[0] if len(parts) == 1 else GroupQuantParts(tuple(parts))  # type: ignore[return-value]


def _cat(a: GroupQuantLinear, b: GroupQuantLinear) -> GroupQuantLinear:
    joined = {
        name: torch.cat([getattr(a, name), getattr(b, name)])
        for name in ARRAY_NAMES
        if getattr(a, name) is not None
    }
    return replace(a, out_features=a.out_features + b.out_features, **joined)
