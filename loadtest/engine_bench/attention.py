"""`splitserve bench attention`: attention time per decode step, torch against the C++ kernels.

A decode step of B sequences with C tokens of context each, on SmolLM2-135M's shapes
(30 layers, 9 heads over 3 KV heads, head_dim 64, block 16; fp32 or bf16): write_kv + attend
per layer, times the layers. Each sequence's blocks are scattered over the cache at random,
and each layer reads a cache of its own (cycled once all would pass 1 GiB), as in a real step:
from memory, not from the last-level cache. The caches are one allocation on 2 MiB pages where
the kernel gives them, as the engine's KV cache is (kv_cache.py): the engine's own decode
steps read at the same pace (docs/engine-speed.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shared.engine.attention import get_backend
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.huge_pages import zeros_on_huge_pages


@dataclass(slots=True, frozen=True)
class AttentionBenchConfig:
    backends: tuple[str, ...] = ("torch", "cpu")
    batches: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (128, 1024)
    layers: int = 30
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    repeats: int = 5
    caches_bytes: int = 1 << 30  # distinct layer caches up to this size in all
    dtype: str = "float32"  # of q and the KV cache


def decode_step(cfg: AttentionBenchConfig, batch: int, context: int):
    """(q [B, heads, d], kv [B, 2, kvh, d], cache, metadata) of one decode step."""
    dtype = getattr(torch, cfg.dtype)
    per_seq = -(-context // cfg.block_size)
    num_blocks = batch * per_seq
    cache = torch.randn(num_blocks, cfg.block_size, 2, cfg.kv_heads, cfg.head_dim).to(dtype)
    tables = torch.randperm(num_blocks).view(batch, per_seq)
    last = tables[:, (context - 1) // cfg.block_size]
    meta = AttentionMetadata(
        slot_mapping=last * cfg.block_size + (context - 1) % cfg.block_size,
        num_decodes=batch,
        decode_block_tables=tables,
        decode_mask=None if context % cfg.block_size == 0 else _mask(cfg, batch, context),
        prefills=[],
    )
    q = torch.randn(batch, cfg.heads, cfg.head_dim).to(dtype)
    kv = torch.randn(batch, 2, cfg.kv_heads, cfg.head_dim).to(dtype)
    return q, kv, cache, meta


def _mask(cfg: AttentionBenchConfig, batch: int, context: int) -> torch.Tensor:
    width = -(-context // cfg.block_size) * cfg.block_size
    return (torch.arange(width) < context).expand(batch, 1, 1, width).contiguous()


def layer_caches(cache: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`count` caches shaped as `cache`, in one allocation on 2 MiB pages where the kernel
    gives them: the first a copy of `cache`, the others random."""
    caches = list(zeros_on_huge_pages((count, *cache.shape), cache.dtype)[0])
    caches[0].copy_(cache)
    for other in caches[1:]:
        other.copy_(torch.randn(cache.shape))
    return caches


def time_step_ms(cfg: AttentionBenchConfig, backend: str, batch: int, context: int) -> float:
    """Best of `repeats` decode steps (all layers), in milliseconds."""
    attention = get_backend(backend)
    q, kv, cache, meta = decode_step(cfg, batch, context)
    distinct = max(1, min(cfg.layers, cfg.caches_bytes // (cache.numel() * cache.element_size())))
    caches = layer_caches(cache, distinct)
    best = float("inf")
    for _ in range(cfg.repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        for layer in range(cfg.layers):
            attention.write_kv(caches[layer % distinct], kv, meta)
            attention.attend(q, kv, caches[layer % distinct], meta)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def run_attention_bench(cfg: AttentionBenchConfig) -> None:
    print(
        f"torch threads: {torch.get_num_threads()}; ms per decode step "
        f"({cfg.layers} layers, {cfg.dtype})"
    )
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{b:>9}" for b in cfg.backends))
    for batch in cfg.batches:
        for context in cfg.contexts:
            times = [time_step_ms(cfg, b, batch, context) for b in cfg.backends]
            print(f"{batch:>5} {context:>7} " + " ".join(f"{t:>9.2f}" for t in times))
