"""The interface every attention backend implements, and the per-layer attention settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shared.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True, frozen=True)
class LayerAttention:
    """What one layer's attention does beyond plain causal softmax(q·k * scale)."""

    scale: float  # softmax scale (head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5)
    # a query at position p sees keys at positions > p - window (itself included); 0: all
    window: int = 0
    softcap: float = 0.0  # scores become softcap * tanh(scores / softcap) (Gemma 2); 0: none


def default_layer(q: torch.Tensor) -> LayerAttention:
    return LayerAttention(scale=q.shape[-1] ** -0.5)


class AttentionBackend(Protocol):
    # whether attend reads `kv` (the new tokens' KV, in the cache's dtype); a backend that
    # does not finds them in the cache, written there before attend
    reads_new_kv: bool

    def write_kv(self, cache: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the new tokens' KV. cache: [num_blocks, block_size, 2, kv_heads, d];
        kv: [T, 2, kv_heads, d]."""

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention | None = None,
    ) -> torch.Tensor:
        """Causal attention of the new tokens over their context (already written), within
        the layer's window. q: [T, heads, d]; kv: the new tokens' [T, 2, kv_heads, d] (in the
        query's dtype where reads_new_kv, else possibly another: not read).
        Returns [T, heads, d]. layer None: plain attention at head_dim ** -0.5."""
