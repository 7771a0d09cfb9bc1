"""The Llama-family decoder over a flat, unpadded batch of tokens and a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine.attention import AttentionBackend
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.model.linear_weights import LinearWeight, PackedLinear
from shared.engine.model.rope import apply_rope_, rope_table
from shared.engine.model.weights import ModelWeights
from shared.engine.model_config import ModelConfig


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        attention: AttentionBackend,
        max_len: int,
    ) -> None:
        self.config = config
        self.weights = weights
        self.attention = attention
        # [max_len, head_dim/2] complex64, beside the weights
        self.rotations = rope_table(config, max_len).to(weights.embed.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: list[torch.Tensor],  # per layer [num_blocks, block_size, 2, kv_heads, d]
        logits_rows: torch.Tensor,  # [S] int64: the rows whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, vocab] float32
        c, w = self.config, self.weights
        t = input_ids.shape[0]
        heads, kv_heads, d = c.num_heads, c.num_kv_heads, c.head_dim
        inter = c.intermediate_size
        eps = c.rms_norm_eps
        norm_shape = (c.hidden_size,)
        rotations = self.rotations[positions].unsqueeze(1)  # [T, 1, d/2]
        h = F.embedding(input_ids, w.embed)  # [T, hidden]
        for layer, cache in zip(w.layers, kv_cache, strict=True):
            x = F.rms_norm(h, norm_shape, layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias).view(t, heads + 2 * kv_heads, d)
            apply_rope_(qkv[:, : heads + kv_heads], rotations)
            q, kv = qkv[:, :heads], qkv[:, heads:].view(t, 2, kv_heads, d)
            self.attention.write_kv(cache, kv, meta)
            attn = self.attention.attend(q, kv, cache, meta)  # [T, heads, d]
            h = h + linear(attn.view(t, heads * d), layer.o_proj)
            gate_up = linear(F.rms_norm(h, norm_shape, layer.post_norm, eps), layer.gate_up)
            h = h + linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.down)
        h = F.rms_norm(h[logits_rows], norm_shape, w.norm, eps)
        # With torch's matmul, the two layouts of the head are each fastest for a different
        # number of rows; packed (batch-invariant) and quantized heads have a single layout.
        head = w.lm_head_column_major if h.shape[0] <= 2 else w.lm_head
        return linear(h, head).float()


def linear(
    x: torch.Tensor,
    w: LinearWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, in] -> [T, out]. `w` is a float matrix (torch's matmul), one packed by
    `batch_invariant.pack_weights` (the batch-invariant C++ kernel), or an int8 / int4 one
    made by `quantization.quantize_weights`, which runs its own kernel."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, PackedLinear):
        return w(x, bias)
    y = w(x)
    return y if bias is None else y + bias
