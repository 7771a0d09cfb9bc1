"""Rotary position embedding in the interleaved (complex) layout, with Llama 3 scaling.

HF checkpoints rotate the two halves of each head (`rotate_half`). The loader permutes the
rows of q_proj and k_proj so that element pairs (2j, 2j+1) hold what HF keeps at (j, j+d/2);
q·k is unchanged by permuting both alike, and the rotation becomes one complex multiply.
"""

from __future__ import annotations

import math

import torch

from shared.engine.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim/2] float32, as transformers computes them (default or `llama3` rope type)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3)")
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(config: ModelConfig, max_len: int) -> torch.Tensor:
    """[max_len, head_dim/2] complex64: e^(i * position * inv_freq)."""
    positions = torch.arange(max_len, dtype=torch.float32)
    angles = torch.outer(positions, inverse_frequencies(config))
    return torch.polar(torch.ones_like(angles), angles)


def interleave_permutation(head_dim: int) -> torch.Tensor:
    """Row order taking one head from HF's half-split layout to the interleaved one."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=1).flatten()


def apply_rope_(x: torch.Tensor, rotations: torch.Tensor) -> None:
    """Rotate x in place. x: [T, heads, head_dim] (a view into qkv); rotations: [T, 1, d/2]."""
    t, heads, d = x.shape
    if x.dtype == torch.float32:
        torch.view_as_complex(x.view(t, heads, d // 2, 2)).mul_(rotations)
        return
    rotated = torch.view_as_complex(x.float().view(t, heads, d // 2, 2)) * rotations
    x.copy_(torch.view_as_real(rotated).view(t, heads, d))  # half types rotate in fp32
