"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from shared.engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def write_kv(self, cache: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the new tokens' KV. cache: [num_blocks, block_size, 2, kv_heads, d];
        kv: [T, 2, kv_heads, d]."""

    def attend(
        self, q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Causal attention of the new tokens over their context (already written).
        q: [T, heads, d]; kv: the new tokens' [T, 2, kv_heads, d]. Returns [T, heads, d]."""
