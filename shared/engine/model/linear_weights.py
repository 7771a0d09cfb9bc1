"""The matrix types a layer's weight may take besides a float tensor.

`PackedLinear` runs the batch-invariant C++ kernel (see batch_invariant.py): an FMA chain in
fp32, or for bf16 weights on a CPU with AVX512-BF16 AMX tiles or bf16 dot products
(csrc/cpu/linear_bf16.cpp).
`PackedGateUp` is a SiLU MLP's gate_up for the same kernel with SiLU·up applied on the way out.
`Int8DotLinear` is W8A8 through AMX-INT8 tiles or AVX512-VNNI (csrc/cpu/linear_int8.cpp:
activations quantized per row, int32 sums), batch-invariant too; `Int8Linear` and
`Int4Linear` are weight-only quantized matrices through torch's kernels (see
quantization.py). Every one but PackedGateUp (`w.silu_mul(x)`) is called as `w(x)`:
x [T, K] -> [T, N]; so is a `GroupQuant` (group_quant.py: GGUF's formats as the checkpoint
shipped them). They live here, apart from the code that makes them, so the weight
layout (model/weights.py) can name them without importing that code.

Quantized kernels:
- int8: symmetric per output channel, w ≈ q * scale, q in [-127, 127].
  With AVX512-VNNI: `Int8DotLinear`, x quantized per row (symmetric, 8 bits) in the kernel.
  Without: `aten._weight_int8pack_mm(x bf16 [T, K], q int8 [N, K], scale bf16 [N])`.
- int4: asymmetric per group of G input columns (32 or 64), w ≈ (q - 8) * scale + zero with
  q in [0, 15] (zero = min + 8 * scale, gpt-fast's convention).
  Matmul: `aten._weight_int4pack_mm_for_cpu(x bf16, packed, G, scales_and_zeros bf16)`
  after `aten._convert_weight_to_int4pack_for_cpu`.
The kernels want bf16 activations to be fast: inputs are cast to bf16 and outputs back.
Off CPU, the same quantized state is dequantized per call (correct, not fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from shared.engine import native
from shared.engine.model.group_quant import GroupQuant

INT4_GROUP_SIZES = (32, 64)
PANEL = 64  # columns per panel of the packed kernels (csrc/cpu/linear_tiles.h)
_ACT = torch.bfloat16  # activation dtype the packed kernels are fast with


@dataclass(slots=True, frozen=True)
class PackedLinear:
    """A float [N, K] matrix laid out for the batch-invariant kernel: [ceil(N / 64), K, 64]."""

    packed: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, w: torch.Tensor) -> PackedLinear:
        """w: [N, K] float32, bfloat16 or float16 (any layout)."""
        return cls(_kernels().pack_linear_weight(w), w.shape[0])

    @property
    def rounds_rows_to_bf16(self) -> bool:
        """bf16 pair-packed (AMX tiles or AVX512-BF16): x's rows go in rounded to bf16, so rows
        already bf16 give the same bits (the fp32 FMA chain takes fp32 rows unrounded)."""
        return _pair_packed(self.packed)

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
    ) -> torch.Tensor:
        """x: [T, K] in fp32 (the engine's activations) or the weight's dtype -> [T, N] in
        x's dtype, or in fp32 with float_out (the same bits as widening x first); bias [N]
        added once, after the sum."""
        return _kernels().linear(x, self.packed, self.out_features, bias, float_out)


@dataclass(slots=True, frozen=True)
class PackedGateUp:
    """A fused gate_up [2 * inter, K] float matrix packed for `linear_silu_mul`: the kernel's
    panels of 64 columns in pairs, gate's 64 then up's same 64, so that one call gives
    silu(gate) * up [T, inter] (the bits of SiLU·up over `PackedLinear`'s product) while each
    pair of panels is in cache, instead of a [T, 2 * inter] product and a second pass over it.
    For SiLU MLPs whose inter is a multiple of 64 (`fits`)."""

    packed: torch.Tensor
    inter: int

    @staticmethod
    def fits(w: torch.Tensor) -> bool:
        return w.shape[0] % (2 * PANEL) == 0

    @classmethod
    def pack(cls, w: torch.Tensor) -> PackedGateUp:
        """w: [2 * inter, K] (gate's rows, then up's), as PackedLinear.pack takes."""
        inter = w.shape[0] // 2
        pairs = w.reshape(2, inter // PANEL, PANEL, w.shape[1]).transpose(0, 1)
        return cls(_kernels().pack_linear_weight(pairs.reshape(2 * inter, w.shape[1])), inter)

    @property
    def rounds_rows_to_bf16(self) -> bool:
        """As PackedLinear's."""
        return _pair_packed(self.packed)

    def silu_mul(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """x: [T, K] fp32 (or bf16 where rounds_rows_to_bf16) -> silu(gate) * up [T, inter]
        fp32, or with bf16_out those values rounded to bf16 (pair-packed only)."""
        return _kernels().linear_silu_mul(x, self.packed, self.inter, bf16_out)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x as silu_mul takes it -> the product [T, 2 * inter] fp32 that silu_mul applies
        SiLU·up to, in the packed order: PANEL columns of gate, the same of up, and so on."""
        return _kernels().linear(x, self.packed, 2 * self.inter, None, True)

    def silu_mul_of(self, product: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [T, inter] fp32 of a `product`: silu_mul's bits, one pass."""
        pairs = product.view(-1, 2 * PANEL)  # each row: a panel of gate, then of up
        return _kernels().silu_mul(pairs).view(product.shape[0], self.inter)


def _pair_packed(packed: torch.Tensor) -> bool:
    """The layout of the bf16 pair kernels: [P, pairs, 2 * 64] (linear_bf16.cpp)."""
    return packed.dtype == torch.bfloat16 and packed.shape[-1] == 2 * PANEL


def _kernels() -> ModuleType:
    kernels = native.load()
    assert kernels is not None, "batch-invariant matmuls without the C++ kernels"
    return kernels


@dataclass(slots=True, frozen=True)
class Int8DotLinear:
    """W8A8: int8 weights per output channel, activations quantized per row by the kernel."""

    packed: torch.Tensor  # [ceil(N / 64), ceil(K / 4), 256] int8
    colsums: torch.Tensor  # [N] int32: sum over k of the int8 weights
    scales: torch.Tensor  # [N] float32
    in_features: int

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8DotLinear:
        """w: [N, K] float (any layout)."""
        q, scales = _int8_per_channel(w)
        packed, colsums = _kernels().pack_int8_quads(q)
        return cls(packed, colsums, scales, w.shape[1])

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, unpacked
        panels, quads, _ = self.packed.shape
        q = self.packed.view(panels, quads, 64, 4).permute(0, 2, 1, 3).reshape(panels * 64, -1)
        return q[: self.out_features, : self.in_features].float() * self.scales[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] -> [T, N] in x's dtype."""
        return _kernels().linear_int8(x, self.packed, self.scales, self.colsums, self.out_features)


def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8 in [-127, 127], scales [N] float32), w ≈ q * scale."""
    w = w.float().contiguous()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [N]
    return torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


@dataclass(slots=True, frozen=True)
class Int8Linear:
    weight: torch.Tensor  # [N, K] int8, row-major
    scales: torch.Tensor  # [N] bf16

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8Linear:
        """w: [N, K] float (any layout)."""
        q, scales = _int8_per_channel(w)
        return cls(q, scales.to(_ACT))

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return self.weight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] -> [T, N] in x's dtype."""
        if x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.dequantize().to(x.dtype))
        return torch.ops.aten._weight_int8pack_mm(x.to(_ACT), self.weight, self.scales).to(x.dtype)


@dataclass(slots=True, frozen=True)
class Int4Linear:
    packed: torch.Tensor  # [N, K / 2] uint8, torch's CPU int4 pack
    scales_and_zeros: torch.Tensor  # [K / G, N, 2] bf16
    group_size: int
    in_features: int

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int = 32) -> Int4Linear:
        """w: [N, K] float (any layout), K a multiple of group_size."""
        n, k = w.shape
        if group_size not in INT4_GROUP_SIZES or k % group_size:
            raise ValueError(f"int4 needs a group size in {INT4_GROUP_SIZES} dividing {k}")
        groups = w.float().reshape(n, k // group_size, group_size)  # [N, K/G, G]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/G]
        scales = (high - low).clamp(min=1e-6) / 15.0
        zeros = low + 8.0 * scales  # so that w ≈ (q - 8) * scale + zero = q * scale + low
        # The grid is min-based (as GGUF Q4_1): a checkpoint that came from Q4_1 is recovered
        # up to the bf16 rounding of scales and zeros.
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 15)
        q = q.reshape(n, k).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, scales_and_zeros.to(_ACT), group_size, k)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, through the kernel itself
        eye = torch.eye(self.in_features, dtype=_ACT)
        return (
            torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.packed, self.group_size, self.scales_and_zeros
            )
            .float()
            .t()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] -> [T, N] in x's dtype."""
        if x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.dequantize().to(x.device, x.dtype))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(_ACT), self.packed, self.group_size, self.scales_and_zeros
        )
        return y.to(x.dtype)


QuantizedLinear = Int8DotLinear | Int8Linear | Int4Linear
# a layer's matrix; GroupQuant: as the checkpoint shipped it (group_quant.py)
LinearWeight = torch.Tensor | PackedLinear | PackedGateUp | QuantizedLinear | GroupQuant
