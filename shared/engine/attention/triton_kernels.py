"""Triton kernels over the paged KV cache: the KV write, and split-K (flash-decoding style)
paged attention for query rows that each see a prefix of their sequence's context.

Cache of one layer: [num_blocks, block_size, 2, kv_heads, d], contiguous. One program of
the attention kernel takes one query row, one KV group (its q_per_kv query heads padded to
a tl.dot tile) and one context split of SPLIT_LEN tokens; a second kernel merges the splits
with their log-sum-exp weights. On CPU these run under TRITON_INTERPRET=1, which must be
set before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.engine.attention.row_plan import RowPlan

SPLIT_LEN = 512  # context tokens per program: long contexts spread over more programs
BLOCK_N = 32  # context tokens per tile inside a program


@triton.jit
def _write_kv(cache_ptr, kv_ptr, slot_ptr, ROW: tl.constexpr, ROW_P: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, ROW_P)
    mask = offs < ROW
    tl.store(cache_ptr + slot * ROW + offs, tl.load(kv_ptr + t * ROW + offs, mask=mask), mask=mask)


@triton.jit
def _attend_split(
    q_ptr, cache_ptr, tables_ptr, row_table_ptr, row_context_ptr,
    acc_ptr, max_ptr, sum_ptr,
    scale, table_width, window, softcap,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, QPK: tl.constexpr, QPK_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    row, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context = tl.load(row_context_ptr + row)
    table = tables_ptr + tl.load(row_table_ptr + row) * table_width
    g, dd = tl.arange(0, QPK_P), tl.arange(0, D_P)
    g_ok, d_ok = g < QPK, dd < D
    q_rows = (row * HEADS + kvh * QPK + g) * D
    q = tl.load(q_ptr + q_rows[:, None] + dd[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0)
    q = q.to(tl.float32)  # 16-bit KV is widened as it loads: exact products, fp32 softmax
    top = tl.full([QPK_P], float("-inf"), tl.float32)
    total = tl.zeros([QPK_P], tl.float32)
    acc = tl.zeros([QPK_P, D_P], tl.float32)
    begin = split * SPLIT_LEN
    end = tl.minimum(context, begin + SPLIT_LEN)
    if window > 0:  # a sliding-window layer: the row sees its last `window` tokens only
        begin = tl.maximum(begin, context - window)
    token_stride = 2 * KV_HEADS * D
    for start in range(begin, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        ok = offs < end
        block = tl.load(table + offs // BLOCK_SIZE, mask=ok, other=0)
        k_at = (block * BLOCK_SIZE + offs % BLOCK_SIZE) * token_stride + kvh * D
        tile = ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + k_at[:, None] + dd[None, :], mask=tile, other=0).to(tl.float32)
        v = tl.load(cache_ptr + k_at[:, None] + KV_HEADS * D + dd[None, :], mask=tile, other=0)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [QPK_P, BLOCK_N]
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)
        s = tl.where(ok[None, :], s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, 1))
        alpha = tl.exp(top - new_top)
        p = tl.exp(s - new_top[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        top = new_top
    at = (row * KV_HEADS + kvh) * NUM_SPLITS + split
    tl.store(max_ptr + at * QPK_P + g, top)
    tl.store(sum_ptr + at * QPK_P + g, total)
    tl.store(acc_ptr + (at * QPK_P + g)[:, None] * D_P + dd[None, :], acc)


@triton.jit
def _merge_splits(
    acc_ptr, max_ptr, sum_ptr, out_ptr,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, QPK: tl.constexpr, QPK_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    row, kvh = tl.program_id(0), tl.program_id(1)
    g, dd = tl.arange(0, QPK_P), tl.arange(0, D_P)
    first = (row * KV_HEADS + kvh) * NUM_SPLITS
    top = tl.full([QPK_P], float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(max_ptr + (first + split) * QPK_P + g))
    total = tl.zeros([QPK_P], tl.float32)
    acc = tl.zeros([QPK_P, D_P], tl.float32)
    for split in range(NUM_SPLITS):
        at = (first + split) * QPK_P + g
        weight = tl.exp(tl.load(max_ptr + at) - top)  # 0 for a split past the context
        total += tl.load(sum_ptr + at) * weight
        acc += tl.load(acc_ptr + at[:, None] * D_P + dd[None, :]) * weight[:, None]
    out = acc / total[:, None]
    out_rows = (row * HEADS + kvh * QPK + g) * D
    mask = (g < QPK)[:, None] & (dd < D)[None, :]
    tl.store(out_ptr + out_rows[:, None] + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def write_kv(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [num_blocks, block_size, 2, kv_heads, d]; kv: [T, 2, kv_heads, d]."""
    row = kv[0].numel() if kv.shape[0] else 0
    _write_kv[(kv.shape[0],)](
        cache, kv.contiguous(), slot_mapping, row, triton.next_power_of_2(row)
    )


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    plan: RowPlan,
    max_context: int,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
):
    """q: [T, heads, d] -> [T, heads, d]; `plan` on q's device; max_context: the longest
    row_context (sets the number of splits without a device sync); scale None: d ** -0.5;
    window > 0: each row sees its last `window` context tokens; softcap > 0: capped scores."""
    rows, heads, d = q.shape
    block_size, kv_heads = cache.shape[1], cache.shape[3]
    qpk = heads // kv_heads
    qpk_p, d_p = max(16, triton.next_power_of_2(qpk)), max(16, triton.next_power_of_2(d))
    splits = triton.cdiv(max_context, SPLIT_LEN)
    acc = torch.empty(rows, kv_heads, splits, qpk_p, d_p, device=q.device, dtype=torch.float32)
    top = torch.empty(rows, kv_heads, splits, qpk_p, device=q.device, dtype=torch.float32)
    total = torch.empty_like(top)
    out = torch.empty_like(q)
    q = q.contiguous()
    _attend_split[(rows, kv_heads, splits)](
        q, cache, plan.block_tables, plan.row_table, plan.row_context,
        acc, top, total,
        d**-0.5 if scale is None else scale, plan.block_tables.shape[1], window, softcap,
        heads, kv_heads, qpk, qpk_p, d, d_p, block_size, BLOCK_N, SPLIT_LEN, splits,
        softcap > 0,
    )  # fmt: skip
    _merge_splits[(rows, kv_heads)](
        acc, top, total, out, heads, kv_heads, qpk, qpk_p, d, d_p, splits
    )
    return out
