"""Reference attention in plain torch: gathers each context's blocks, then SDPA.

Decodes run as one batched SDPA call with the query heads of each KV group laid along the
query-length axis ([D, kv_heads, q_per_kv, d]), so GQA needs no copy of K or V. Prefill
chunks run one SDPA call each; a chunk with no earlier context uses its own fresh KV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine.attention.metadata import AttentionMetadata, PrefillChunk


class TorchAttention:
    def write_kv(self, cache: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        slots = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, 2, kv_heads, d]
        slots.index_copy_(0, meta.slot_mapping, kv)

    def attend(
        self, q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        d_rows = meta.num_decodes
        if d_rows:
            out[:d_rows] = self._decode(q[:d_rows], cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], kv[rows], cache, chunk)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d_rows, heads, d = q.shape
        kv_heads = cache.shape[3]
        tables = meta.decode_block_tables  # [D, max_blocks]
        ctx = cache.index_select(0, tables.view(-1))  # [D * max_blocks, block_size, 2, kvh, d]
        ctx = ctx.view(d_rows, -1, 2, kv_heads, d).permute(2, 0, 3, 1, 4)  # [2, D, kvh, S, d]
        grouped = q.view(d_rows, kv_heads, heads // kv_heads, d)  # [D, kvh, q_per_kv, d]
        out = F.scaled_dot_product_attention(grouped, ctx[0], ctx[1], attn_mask=meta.decode_mask)
        return out.reshape(d_rows, heads, d)

    @staticmethod
    def _prefill(
        q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, chunk: PrefillChunk
    ) -> torch.Tensor:
        n = chunk.query_len
        if chunk.context_len == n:  # nothing cached before this chunk: attend to itself
            keys, values = kv[:, 0], kv[:, 1]  # [n, kvh, d]
            mask, causal = None, True
        else:
            ctx = cache.index_select(0, chunk.block_table).flatten(0, 1)[: chunk.context_len]
            keys, values = ctx[:, 0], ctx[:, 1]
            # query i sits at position context_len - n + i and sees keys up to there
            offset = chunk.context_len - n
            rows = torch.arange(n, device=q.device).unsqueeze(1) + offset  # [n, 1]
            keys_at = torch.arange(chunk.context_len, device=q.device).unsqueeze(0)  # [1, C]
            mask, causal = keys_at <= rows, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, heads, n, d]
            keys.transpose(0, 1).unsqueeze(0),  # [1, kvh, C, d]
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)  # [n, heads, d]
