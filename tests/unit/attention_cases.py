"""Random paged-attention steps for the backend tests: a cache, a batch, its metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.attention.metadata import AttentionMetadata, PrefillChunk


@dataclass(slots=True)
class Step:
    cache: torch.Tensor  # [num_blocks, block_size, 2, kv_heads, d], context already written
    q: torch.Tensor  # [T, heads, d]
    kv: torch.Tensor  # [T, 2, kv_heads, d], the new tokens' KV
    meta: AttentionMetadata


def make_step(
    decode_lens: list[int],
    prefills: list[tuple[int, int]],  # (cached tokens before the chunk, chunk length)
    *,
    heads: int,
    kv_heads: int,
    d: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Step:
    """A step whose new tokens' KV is already in the cache (as after write_kv), with the
    blocks of every sequence drawn at random from a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    contexts = decode_lens + [cached + n for cached, n in prefills]
    needs = [-(-n // block_size) for n in contexts]
    num_blocks = sum(needs) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for need in needs:
        tables.append(order[used : used + need])
        used += need
    cache = torch.randn(num_blocks, block_size, 2, kv_heads, d, generator=gen).to(dtype)
    slots: list[int] = []
    for table, n in zip(tables[: len(decode_lens)], decode_lens, strict=True):
        slots.append(int(table[(n - 1) // block_size]) * block_size + (n - 1) % block_size)
    chunks, row = [], len(decode_lens)
    for table, (cached, n) in zip(tables[len(decode_lens) :], prefills, strict=True):
        slots += [
            int(table[p // block_size]) * block_size + p % block_size
            for p in range(cached, cached + n)
        ]
        chunks.append(PrefillChunk(row, n, cached + n, table.clone()))
        row += n
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    kv = cache.view(-1, 2, kv_heads, d)[slot_mapping].clone()
    q = torch.randn(len(slots), heads, d, generator=gen).to(dtype)
    width = max((len(t) for t in tables[: len(decode_lens)]), default=0)
    decode_tables = torch.zeros(len(decode_lens), width, dtype=torch.int64)
    for i, table in enumerate(tables[: len(decode_lens)]):
        decode_tables[i, : len(table)] = table
    keys = torch.arange(width * block_size).unsqueeze(0)
    mask = keys < torch.tensor(decode_lens, dtype=torch.int64).view(-1, 1)  # [D, S]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=len(decode_lens),
        decode_block_tables=decode_tables,
        decode_mask=mask.view(len(decode_lens), 1, 1, -1) if decode_lens else None,
        prefills=chunks,
    )
    return Step(cache, q, kv, meta)
