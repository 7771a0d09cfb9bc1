"""What crosses from a prefill engine to a decode engine: KV blocks and a reservation.

The mesh serialises these (shared/kvtransfer); the engine only produces and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


class OutOfBlocks(RuntimeError):
    """The engine has too few free KV blocks for this request right now."""
