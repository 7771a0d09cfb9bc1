"""KV chunking: KVBlocks → KVChunks under a byte limit and back, bit-exact; bad chunks refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine.kv_handoff import KVBlocks
from shared.kvtransfer import BadChunk, KVLayout, from_chunk, to_chunks
from shared.protocol import KVChunk, decode, encode

LAYOUT = KVLayout(num_layers=4, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def make_blocks(dtype: torch.dtype = torch.float32, layers: int = 4, blocks: int = 5) -> KVBlocks:
    data = torch.randn(layers, blocks, *LAYOUT.block_shape).to(dtype)
    return KVBlocks("r1", 0, layers, 2, [11, 12, 13, 14, None][:blocks], data)


def reassemble(chunks: list[KVChunk], layout: KVLayout, like: KVBlocks) -> torch.Tensor:
    out = torch.full_like(like.data, float("nan"))
    for chunk in chunks:
        part = from_chunk(decode(encode(chunk), KVChunk), layout, num_reserved_blocks=7)
        assert part.block_hashes == like.block_hashes[part.first_block - 2 :][: part.data.shape[1]]
        layers = slice(part.layer_start, part.layer_end)
        blocks = slice(part.first_block - 2, part.first_block - 2 + part.data.shape[1])
        out[layers, blocks] = part.data
    return out


@pytest.mark.parametrize(
    ("max_blocks", "expected_chunks"),
    [(100, 1), (10, 2), (5, 4), (3, 8), (1, 20)],  # limit in block-layers of bytes
)
def test_split_under_limit_and_back_is_bit_exact(max_blocks, expected_chunks):
    blocks = make_blocks()
    max_bytes = max_blocks * LAYOUT.block_bytes
    chunks = to_chunks(blocks, max_bytes, first_index=3)
    assert len(chunks) == expected_chunks
    assert [c.chunk_index for c in chunks] == list(range(3, 3 + expected_chunks))
    assert all(len(c.data) <= max_bytes for c in chunks)
    assert torch.equal(reassemble(chunks, LAYOUT, blocks), blocks.data)


def test_bfloat16_round_trip_is_bit_exact():
    blocks = make_blocks(torch.bfloat16)
    layout = dataclasses.replace(LAYOUT, dtype="bfloat16")
    chunks = to_chunks(blocks, 2 * layout.block_bytes)
    assert chunks[0].dtype == "bfloat16"
    out = reassemble(chunks, layout, blocks)
    assert torch.equal(out.view(torch.int16), blocks.data.view(torch.int16))


def test_a_block_over_the_limit_is_refused():
    with pytest.raises(ValueError, match="over the"):
        to_chunks(make_blocks(), LAYOUT.block_bytes - 1)


def test_no_blocks_means_no_chunks():
    assert to_chunks(make_blocks(blocks=0), LAYOUT.block_bytes) == []


def _good() -> KVChunk:
    return to_chunks(make_blocks(), 100 * LAYOUT.block_bytes)[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"shape": [4, 5, 4, 2, 2, 4]}, "shape"),
        ({"shape": [4, 5, 4]}, "shape"),
        ({"layer_start": 1}, "layer range"),
        ({"layer_end": 5}, "outside"),
        ({"layer_start": 2, "layer_end": 2}, "outside"),
        ({"first_block": 3}, "reserved"),
        ({"first_block": -1}, "reserved"),
        ({"block_hashes": [1, 2]}, "hashes"),
        ({"data": b"\0" * 10}, "data bytes"),
    ],
)
def test_bad_layout_is_refused_with_the_reason(change, message):
    chunk = dataclasses.replace(_good(), **change)
    with pytest.raises(BadChunk, match=message):
        from_chunk(chunk, LAYOUT, num_reserved_blocks=7)
