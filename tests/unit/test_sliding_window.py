"""Sliding-window and soft-capped attention in every backend against a per-row reference
that reads each row's window straight from the paged cache: decodes and prefill chunks
(over a cached prefix or not), windows shorter than a block, spanning blocks, and, for
Triton, crossing its context splits."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are defined

import pytest
import torch

from shared.engine import native
from shared.engine.attention import get_backend
from shared.engine.attention.base import LayerAttention
from tests.unit.attention_cases import Step, make_step

DECODES = [1, 9, 40, 700]  # 700: two of Triton's 512-token splits
PREFILLS = [(0, 30), (25, 12)]
LAYERS = {
    "window-3": LayerAttention(scale=0.3, window=3),
    "window-20-capped": LayerAttention(scale=0.25, window=20, softcap=2.0),
    "window-600": LayerAttention(scale=0.25, window=600),
    "capped-global": LayerAttention(scale=0.25, softcap=1.5),
}


def reference(step: Step, layer: LayerAttention, block_size: int) -> torch.Tensor:
    """Each row over its own window, gathered token by token from its block table."""
    meta, out = step.meta, torch.empty_like(step.q)
    rows = [(meta.decode_block_tables[i], n) for i, n in enumerate(DECODES)]
    for chunk in meta.prefills:
        first = chunk.context_len - chunk.query_len
        rows += [(chunk.block_table, first + j + 1) for j in range(chunk.query_len)]
    heads, kv_heads = step.q.shape[1], step.cache.shape[3]
    for r, (table, context) in enumerate(rows):
        start = max(0, context - layer.window) if layer.window else 0
        slots = [
            int(table[p // block_size]) * block_size + p % block_size for p in range(start, context)
        ]
        kv = step.cache.view(-1, 2, kv_heads, step.q.shape[2])[slots]  # [n, 2, kvh, d]
        k = kv[:, 0].repeat_interleave(heads // kv_heads, 1)  # [n, heads, d]
        v = kv[:, 1].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,nhd->hn", step.q[r], k) * layer.scale
        if layer.softcap:
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize(
    "backend", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.slow)]
)
def test_windowed_attention_matches_a_per_row_reference(backend, layer):
    if backend == "cpu" and native.load() is None:
        pytest.skip("needs the C++ kernels")
    if (
        backend == "triton"
        and os.environ["TRITON_INTERPRET"] != "1"
        and not torch.cuda.is_available()
    ):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    block_size = 8
    step = make_step(DECODES, PREFILLS, heads=4, kv_heads=2, d=16, block_size=block_size)
    device = "cuda" if backend == "triton" and os.environ["TRITON_INTERPRET"] != "1" else "cpu"
    ours = get_backend(backend).attend(
        step.q.to(device), step.kv.to(device), step.cache.to(device), step.meta, LAYERS[layer]
    )
    torch.testing.assert_close(
        ours.cpu(), reference(step, LAYERS[layer], block_size), atol=2e-5, rtol=0
    )
