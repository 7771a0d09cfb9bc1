"""`KVBlocks` ⇄ `KVChunk`: cut exported blocks into frames under a byte limit, and check a
received frame against the receiver's cache layout before it becomes `KVBlocks` again."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.engine.engine_config import torch_dtypes
from shared.engine.kv_handoff import KVBlocks
from shared.errors import ConfigError
from shared.protocol import KVChunk

DTYPES = torch_dtypes()  # name → torch dtype, the names KVLayout and KVChunk carry


class BadChunk(ValueError):
    """A KV chunk that does not fit the receiver's cache or reservation."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a worker's KV cache looks like; both ends of a transfer must agree on it."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")

    @property
    def block_shape(self) -> list[int]:
        return [self.block_size, 2, self.num_kv_heads, self.head_dim]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return math.prod(self.block_shape) * DTYPES[self.dtype].itemsize


def to_chunks(blocks: KVBlocks, max_bytes: int, first_index: int = 0) -> list[KVChunk]:
    """Split `blocks` into chunks of at most `max_bytes` of data each: whole layers of all
    blocks when a layer fits, else runs of blocks of one layer."""
    data = blocks.data.contiguous()  # [layers, blocks, block_size, 2, kv_heads, d]
    num_layers, num_blocks = data.shape[0], data.shape[1]
    block_bytes = data[0, 0].numel() * data.element_size() if num_blocks else 0
    if block_bytes > max_bytes:
        raise ConfigError(f"one KV block is {block_bytes} bytes, over the {max_bytes} limit")
    if num_blocks == 0:
        return []
    blocks_per_chunk = min(num_blocks, max_bytes // block_bytes)
    layers_per_chunk = 1
    if blocks_per_chunk == num_blocks:
        layers_per_chunk = max(1, max_bytes // (block_bytes * num_blocks))
    dtype = next(name for name, t in DTYPES.items() if t == data.dtype)
    chunks = []
    for layer in range(0, num_layers, layers_per_chunk):
        layer_end = min(num_layers, layer + layers_per_chunk)
        for block in range(0, num_blocks, blocks_per_chunk):
            block_end = min(num_blocks, block + blocks_per_chunk)
            part = data[layer:layer_end, block:block_end].contiguous()
            chunks.append(
                KVChunk(
                    request_id=blocks.request_id,
                    chunk_index=first_index + len(chunks),
                    layer_start=blocks.layer_start + layer,
                    layer_end=blocks.layer_start + layer_end,
                    first_block=blocks.first_block + block,
                    block_hashes=blocks.block_hashes[block:block_end],
                    dtype=dtype,
                    shape=list(part.shape),
                    data=part.view(torch.uint8).numpy().tobytes(),
                )
            )
    return chunks


def from_chunk(chunk: KVChunk, layout: KVLayout, num_reserved_blocks: int) -> KVBlocks:
    """Check every field of `chunk` against `layout` and the reservation; raise BadChunk."""
    if chunk.dtype != layout.dtype:
        raise BadChunk(f"dtype {chunk.dtype!r}, this worker's cache is {layout.dtype!r}")
    if len(chunk.shape) != 6 or list(chunk.shape[2:]) != layout.block_shape:
        raise BadChunk(f"shape {chunk.shape} is not [layers, blocks, *{layout.block_shape}]")
    if not 0 <= chunk.layer_start < chunk.layer_end <= layout.num_layers:
        raise BadChunk(
            f"layers [{chunk.layer_start}, {chunk.layer_end}) outside [0, {layout.num_layers})"
        )
    if chunk.shape[0] != chunk.layer_end - chunk.layer_start:
        raise BadChunk(f"shape {chunk.shape} does not match the layer range")
    num_blocks = chunk.shape[1]
    if num_blocks < 1 or num_blocks != len(chunk.block_hashes):
        raise BadChunk(f"{num_blocks} blocks in shape, {len(chunk.block_hashes)} hashes")
    if chunk.first_block < 0 or chunk.first_block + num_blocks > num_reserved_blocks:
        raise BadChunk(
            f"blocks [{chunk.first_block}, {chunk.first_block + num_blocks}) outside "
            f"the {num_reserved_blocks} reserved"
        )
    expected_bytes = chunk.shape[0] * num_blocks * layout.block_bytes
    if len(chunk.data) != expected_bytes:
        raise BadChunk(f"{len(chunk.data)} data bytes, the shape needs {expected_bytes}")
    data = torch.frombuffer(bytearray(chunk.data), dtype=DTYPES[layout.dtype])
    return KVBlocks(
        request_id=chunk.request_id,
        layer_start=chunk.layer_start,
        layer_end=chunk.layer_end,
        first_block=chunk.first_block,
        block_hashes=list(chunk.block_hashes),
        data=data.reshape(chunk.shape),
    )
