"""FP8 weights (compressed-tensors float-quantized; vLLM's own `fp8`) -> their FP8 E4M3
values and one scale per row and group of 32 columns: w[n, k] = weight[n, k] * scale[n, k /
32], the stored scale of the tensor, row, group or block (rows x columns) that [n, k] falls in.
As compressed-tensors' FloatQuantizationCompressor stores them: `weight` float8_e4m3fn [N, K],
`weight_scale` [N, 1] or [1] (tensor), [N, K / G] (group), [ceil(N / R), ceil(K / C)] (block);
vLLM's `fp8` as its Fp8LinearMethod loads them: `weight_scale` one per tensor, or
`weight_scale_inv` [ceil(N / R), ceil(K / C)] per block (fp32, bf16, fp16 or e8m0 scales); a
static activation scheme's `input_scale` read past.

The one subtle rule: the values stay FP8 (one byte a weight, each exact in fp32) and a scale
is only widened to fp32, so the kernel's one product value * scale is the format's weight up
to that one rounding; a NaN code (0x7F, 0xFF), which no quantizer writes, and a scale that is
not finite are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shared.models.wna16_config import PARTS, Wna16Config

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e8m0fnu)


@dataclass(slots=True)
class Fp8Weights:
    values: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [N, K / 32] float32


def unpack_fp8(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> Fp8Weights:
    """A matrix's stored parts -> Fp8Weights; ValueError naming the part that is missing or of
    the wrong shape or dtype."""
    name = config.scale_part
    missing = [p for p in ("weight", name) if p not in parts]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    unknown = sorted(set(parts) - set(PARTS[config.format]))
    if unknown:
        raise ValueError(f"unexpected parts {unknown}")
    weight, scale = parts["weight"], parts[name]
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"weight is {tuple(weight.shape)} {weight.dtype}, expected 2-D float8_e4m3fn"
        )
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"{k} input columns: the FP8 kernel takes a multiple of 32")
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name} is {scale.dtype}, expected a float dtype")
    rows, cols = _block(config, n, k)
    grid = (-(-n // rows), -(-k // cols))  # the scales' [rows, columns]
    fits = scale.numel() == grid[0] * grid[1] and (grid[1] == 1 or scale.dim() == 2)
    if not fits or (grid[1] > 1 and tuple(scale.shape) != grid):
        raise ValueError(f"{name} is {tuple(scale.shape)}, expected {_expected(config, grid)}")
    if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise ValueError("weight holds FP8 NaN codes")
    widened = scale.to(torch.float32).reshape(grid)
    if not bool(widened.isfinite().all()):
        raise ValueError(f"{name} holds scales that are not finite")
    per_row = widened.repeat_interleave(rows, 0)[:n]
    scales = per_row.repeat_interleave(-(-cols // 32), 1)[:, : k // 32]
    return Fp8Weights(weight.contiguous(), scales.contiguous())


def _block(config: Wna16Config, n: int, k: int) -> tuple[int, int]:
    """The rows and columns one scale covers."""
    if config.per_tensor:
        return n, k
    return config.block_rows, config.group or k


def _expected(config: Wna16Config, grid: tuple[int, int]) -> str:
    if config.per_tensor:
        return "one per tensor"
    if grid[1] == 1:
        return f"{grid[0]} (one per row)"
    what = f"block of {config.block_rows} x {config.group}" if config.block_rows > 1 else "group"
    return f"{grid} (one per {what})"
