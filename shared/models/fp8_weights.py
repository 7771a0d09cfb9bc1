"""compressed-tensors float-quantized (FP8) weights -> their FP8 E4M3 values and one scale per
row: w[n, k] = weight[n, k] * weight_scale[n] (a per-tensor scale repeated for every row), as
its FloatQuantizationCompressor stores them (`weight` float8_e4m3fn [N, K], `weight_scale`
[N, 1] or [1], fp32, bf16 or fp16; a static activation scheme's `input_scale` read past).

The one subtle rule: the values stay FP8 (one byte a weight, each exact in fp32) and a scale
is only widened to fp32, so the kernel's one product value * scale is the format's weight up
to that one rounding; a NaN code (0x7F, 0xFF), which no quantizer writes, is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shared.models.wna16_config import PARTS, QuantFormat, Wna16Config


@dataclass(slots=True)
class Fp8Rows:
    values: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [N] float32


def unpack_fp8(config: Wna16Config, parts: Mapping[str, torch.Tensor]) -> Fp8Rows:
    """A matrix's stored parts -> Fp8Rows; ValueError naming the part that is missing or of
    the wrong shape or dtype."""
    missing = [p for p in ("weight", "weight_scale") if p not in parts]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    unknown = sorted(set(parts) - set(PARTS[QuantFormat.FP8]))
    if unknown:
        raise ValueError(f"unexpected parts {unknown}")
    weight, scale = parts["weight"], parts["weight_scale"]
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"weight is {tuple(weight.shape)} {weight.dtype}, expected 2-D float8_e4m3fn"
        )
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"{k} input columns: the FP8 kernel takes a multiple of 32")
    if scale.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"weight_scale is {scale.dtype}, expected a float dtype")
    rows = 1 if config.per_tensor else n
    if scale.numel() != rows:
        expected = "one per tensor" if config.per_tensor else f"{n} (one per row)"
        raise ValueError(f"weight_scale is {tuple(scale.shape)}, expected {expected}")
    if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise ValueError("weight holds FP8 NaN codes")
    scales = scale.to(torch.float32).reshape(rows).expand(n).contiguous()
    return Fp8Rows(weight.contiguous(), scales)
