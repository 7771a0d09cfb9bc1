"""Rotary position embedding in the interleaved (complex) layout, with every rope scaling
transformers implements for the families we serve: linear, dynamic (NTK), yarn, llama3 and
longrope (Phi-3's `su`).

HF checkpoints rotate the two halves of each head (`rotate_half`). The loader permutes the
rows of q_proj and k_proj so that element pairs (2j, 2j+1) hold what HF keeps at (j, j+d/2);
q·k is unchanged by permuting both alike, and the rotation becomes one complex multiply.
With a partial rotary dim (Phi-4-mini) only the leading `rotated_dims` of a head rotate.

The table holds one rotation per position. yarn's and longrope's attention factor is its
magnitude (HF scales cos and sin). The two scalings that transformers recomputes from the
sequence length behave here as in HF's incremental decoding: dynamic NTK uses, at position
p, the frequencies for a sequence of max(p + 1, max_position_embeddings) tokens; longrope
uses the short factors below `original_max_position_embeddings` and the long ones from it.
"""

from __future__ import annotations

import math

import torch

from shared.engine.model_config import ModelConfig
from shared.errors import ConfigError


def _base_frequencies(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low_freq_factor = float(s["low_freq_factor"])
    high_freq_factor = float(s["high_freq_factor"])
    old_context_len = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_attention_factor(s: dict, max_positions: int) -> float:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / original
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rotation_angles(
    config: ModelConfig, max_len: int, theta: float | None = None, scaling: dict | None = None
) -> tuple[torch.Tensor, float]:
    """([max_len, rotated_dims/2] float32 angles position * inv_freq, attention factor)."""
    theta = config.rope_theta if theta is None else theta
    s = config.rope_scaling if scaling is None else scaling
    dim = config.rotated_dims
    positions = torch.arange(max_len, dtype=torch.float32)
    rope_type = s.get("rope_type", "default")
    inv_freq = _base_frequencies(theta, dim)
    attention_factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(s["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, s)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(theta, dim, s, config.max_position_embeddings)
    elif rope_type == "dynamic":
        factor, trained = float(s["factor"]), config.max_position_embeddings
        seq_len = torch.clamp(positions + 1, min=trained).unsqueeze(1)  # [max_len, 1]
        base = theta * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
        return positions.unsqueeze(1) * (1.0 / base**exponents), 1.0
    elif rope_type == "longrope":
        original = s["original_max_position_embeddings"]
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * theta**shape)
        long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * theta**shape)
        per_position = torch.where((positions < original).unsqueeze(1), short, long)
        attention_factor = _longrope_attention_factor(s, config.max_position_embeddings)
        return positions.unsqueeze(1) * per_position, attention_factor
    elif rope_type != "default":
        raise ConfigError(
            f"rope_scaling type {rope_type!r} is not supported "
            "(default, linear, dynamic, yarn, llama3, longrope)"
        )
    return torch.outer(positions, inv_freq), attention_factor


def rope_table(
    config: ModelConfig, max_len: int, theta: float | None = None, scaling: dict | None = None
) -> torch.Tensor:
    """[max_len, rotated_dims/2] complex64: attention_factor * e^(i * angle)."""
    angles, attention_factor = rotation_angles(config, max_len, theta, scaling)
    return torch.polar(torch.full_like(angles, attention_factor), angles)


def interleave_permutation(head_dim: int, rotated_dims: int | None = None) -> torch.Tensor:
    """Row order taking one head from HF's half-split layout to the interleaved one (only
    the leading `rotated_dims` are paired; the rest keep their places)."""
    rot = rotated_dims or head_dim
    half = torch.arange(rot // 2)
    paired = torch.stack([half, half + rot // 2], dim=1).flatten()
    return torch.cat([paired, torch.arange(rot, head_dim)])


def apply_rope_(x: torch.Tensor, rotations: torch.Tensor) -> None:
    """Rotate x in place. x: [T, heads, head_dim] (a view into qkv); rotations: [T, 1, r/2]
    for the leading r dims of each head."""
    t, heads, d = x.shape
    r = rotations.shape[-1] * 2
    pairs = x.view(t, heads, d // 2, 2)[:, :, : r // 2]
    if x.dtype == torch.float32:
        torch.view_as_complex(pairs).mul_(rotations)
        return
    rotated = torch.view_as_complex(pairs.float()) * rotations
    pairs.copy_(torch.view_as_real(rotated))  # half types rotate in fp32
