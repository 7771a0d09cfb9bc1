"""Reference attention in plain torch: gathers each context's blocks, then SDPA.

Decodes run as one batched SDPA call with the query heads of each KV group laid along the
query-length axis ([D, kv_heads, q_per_kv, d]), so GQA needs no copy of K or V. Prefill
chunks run one SDPA call each; a chunk with no earlier context uses its own fresh KV.
A sliding window is one more term of the boolean mask; soft-capped scores (Gemma 2), which
SDPA cannot apply, take the explicit softmax of `_capped_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine.attention.base import LayerAttention, default_layer
from shared.engine.attention.metadata import AttentionMetadata, PrefillChunk
from shared.engine.attention.row_plan import decode_lengths


class TorchAttention:
    reads_new_kv = True  # a prefill chunk attends over its own new KV with the cached context

    def write_kv(self, cache: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        slots = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, 2, kv_heads, d]
        slots.index_copy_(0, meta.slot_mapping, kv)

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerAttention | None = None,
    ) -> torch.Tensor:
        layer = layer or default_layer(q)
        out = torch.empty_like(q)
        d_rows = meta.num_decodes
        if d_rows:
            out[:d_rows] = self._decode(q[:d_rows], cache, meta, layer)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], kv[rows], cache, chunk, layer)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, layer: LayerAttention
    ) -> torch.Tensor:
        d_rows, heads, d = q.shape
        kv_heads = cache.shape[3]
        tables = meta.decode_block_tables  # [D, max_blocks]
        ctx = cache.index_select(0, tables.view(-1))  # [D * max_blocks, block_size, 2, kvh, d]
        ctx = ctx.view(d_rows, -1, 2, kv_heads, d).permute(2, 0, 3, 1, 4)  # [2, D, kvh, S, d]
        grouped = q.view(d_rows, kv_heads, heads // kv_heads, d)  # [D, kvh, q_per_kv, d]
        mask = meta.decode_mask
        if layer.window:
            lengths = decode_lengths(meta, cache.shape[1]).view(d_rows, 1, 1, 1)
            keys = torch.arange(ctx.shape[3], device=q.device).view(1, 1, 1, -1)
            mask = (keys < lengths) & (keys >= lengths - layer.window)  # [D, 1, 1, S]
        out = _attention(grouped, ctx[0], ctx[1], mask, False, layer)
        return out.reshape(d_rows, heads, d)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        kv: torch.Tensor,
        cache: torch.Tensor,
        chunk: PrefillChunk,
        layer: LayerAttention,
    ) -> torch.Tensor:
        n = chunk.query_len
        if chunk.context_len == n:  # nothing cached before this chunk: attend to itself
            keys, values = kv[:, 0], kv[:, 1]  # [n, kvh, d]
        else:
            ctx = cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.context_len]
            keys, values = ctx[:, 0], ctx[:, 1]
        mask, causal = None, True
        if chunk.context_len != n or layer.window:
            # query i sits at position context_len - n + i and sees keys up to there
            offset = chunk.context_len - n
            rows = torch.arange(n, device=q.device).unsqueeze(1) + offset  # [n, 1]
            keys_at = torch.arange(chunk.context_len, device=q.device).unsqueeze(0)  # [1, C]
            mask, causal = keys_at <= rows, False
            if layer.window:
                mask &= keys_at > rows - layer.window
        out = _attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, heads, n, d]
            keys.transpose(0, 1).unsqueeze(0),  # [1, kvh, C, d]
            values.transpose(0, 1).unsqueeze(0),
            mask,
            causal,
            layer,
        )
        return out[0].transpose(0, 1)  # [n, heads, d]


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    layer: LayerAttention,
) -> torch.Tensor:
    """q: [B, heads, n, d], k and v: [B, kv_heads, S, d], mask: bool [B or 1, 1, n, S]."""
    if not layer.softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=layer.scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * layer.scale  # [..., n, S]
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if causal:
        n, s = scores.shape[-2:]
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)
