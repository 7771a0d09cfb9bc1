"""The Llama-family decoder over a flat, unpadded batch of tokens and a paged KV cache:
Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3 (q/k norms) and Phi-3/4 (fused checkpoints, partial
rope, LongRoPE) differ only in their weights and config, read by weights.py and
model_config.py; the layer is pre-norm attention then a pre-norm gated MLP."""

from __future__ import annotations

import torch

from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.model.decoder import DecoderModel, linear
from shared.engine.model.native_layer import NativeLayers
from shared.engine.model.weights import LayerWeights

__all__ = ["LlamaModel", "linear"]


class LlamaModel(DecoderModel):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # each layer as one native call where that runs the kernels the loop below would (an
        # MoE model's MLP is its own)
        if type(self).mlp is LlamaModel.mlp:
            self.native_layers = NativeLayers.fitting(
                self.ops.native, self.attention, self.config, self.weights.layers, self.bf16_rows
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: list[torch.Tensor],  # per layer [num_blocks, block_size, 2, kv_heads, d]
        logits_rows: torch.Tensor,  # [S] int64: the rows whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, vocab] float32
        w = self.weights
        rope = self.ops.rope(self.rotations, positions)
        h = self.embed(input_ids)  # [T, hidden]
        y = None  # the previous layer's MLP output, joining the residual stream
        native = self.native_call()
        for i, (layer, cache) in enumerate(zip(w.layers, kv_cache, strict=True)):
            keep = self.rows_kept_after(i, logits_rows, h.shape[0])
            if native is not None:
                base = self.base_layers[i]
                h, y = native(h, y, base, cache, rope, meta, keep, self.layer_attention[i])
                continue
            if y is None:
                x = self.norm(h, layer.input_norm, self.bf16_rows)
            else:
                h, x = self.ops.add_norm(h, y, layer.input_norm, self.bf16_rows)
            attn = self.self_attention(i, x, layer, cache, rope, meta, keep)
            if keep is not None:
                h = h[keep]
            h, x = self.ops.add_norm(h, attn, layer.post_norm, self.bf16_rows)
            y = self.mlp(x, layer)
        assert y is not None, "a model has layers"
        return self.logits(h + y)  # the last layer kept only the rows of logits_rows

    def mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """x: [T, hidden], normed -> [T, hidden]."""
        return self.dense_mlp(x, layer)
