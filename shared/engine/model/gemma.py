"""Gemma 2 and Gemma 3: the embedding scaled by sqrt(hidden), (1 + w) RMSNorms (offset at
load), a norm on the input and on the output of both attention and MLP, GeGLU (tanh GELU),
queries scaled by query_pre_attn_scalar ** -0.5, alternating sliding-window and global
layers. Gemma 2 soft-caps attention scores and logits; Gemma 3 norms q and k per head and
gives its sliding layers their own rope base."""

from __future__ import annotations

import torch

from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.model.decoder import DecoderModel


class GemmaModel(DecoderModel):
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: list[torch.Tensor],  # per layer [num_blocks, block_size, 2, kv_heads, d]
        logits_rows: torch.Tensor,  # [S] int64
    ) -> torch.Tensor:  # [S, vocab] float32
        w = self.weights
        global_rope = self.ops.rope(self.rotations, positions)
        local_rope = self.ops.rope(self.local_rotations, positions)
        h = self.embed(input_ids)  # [T, hidden]
        h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        for i, (layer, cache) in enumerate(zip(w.layers, kv_cache, strict=True)):
            local = self.config.window_of(i) and self.config.local_rope_theta
            rope = local_rope if local else global_rope
            x = self.norm(h, layer.input_norm)
            keep = self.rows_kept_after(i, logits_rows, h.shape[0])
            x = self.self_attention(i, x, layer, cache, rope, meta, keep)
            if keep is not None:
                h = h[keep]
            h = h + self.norm(x, layer.attn_out_norm)
            x = self.dense_mlp(self.norm(h, layer.post_norm), layer)
            h = h + self.norm(x, layer.mlp_out_norm)
        return self.logits(h)  # the last layer kept only the rows of logits_rows
