"""What crosses from a prefill engine to a decode engine: KV blocks and a reservation.

The mesh serialises these (shared/kvtransfer); the engine only produces and checks them
(`check_offered`: received blocks against a reservation, for the engine and the worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.errors import InvalidRequest


@dataclass(slots=True)
class Reservation:
    block_ids: list[int]  # the decode engine's blocks for the whole prompt, in order
    num_cached_blocks: int  # leading blocks it already holds (prefix cache): not to be sent


@dataclass(slots=True)
class KVBlocks:
    request_id: str
    layer_start: int
    layer_end: int  # exclusive
    first_block: int  # index in the request's block table of the first block carried
    block_hashes: list[int | None]  # chained hash per block; None for a partly filled block
    data: torch.Tensor  # [layers, blocks, block_size, 2, kv_heads, head_dim]

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


def check_offered(
    request_id: str,
    num_reserved: int,
    expected_hashes: Sequence[int | None],
    first_block: int,
    block_hashes: list[int | None],
) -> range:
    """The reservation's block indices the offered blocks fill, after checking they fit in
    it and that every full block's hash is the prompt's (InvalidRequest, field `kv`)."""
    end = first_block + len(block_hashes)
    if first_block < 0 or end > num_reserved:
        raise InvalidRequest("kv", f"{request_id}: blocks [{first_block}, {end}) out of range")
    for index, block_hash in enumerate(block_hashes, start=first_block):
        due = expected_hashes[index] if index < len(expected_hashes) else None
        if block_hash is not None and due is not None and block_hash != due:
            reason = f"{request_id}: block {index} hash does not match the prompt"
            raise InvalidRequest("kv", reason)
    return range(first_block, end)
