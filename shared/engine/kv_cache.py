"""The paged KV cache tensors, and copies of whole blocks in and out of them.

One tensor per layer: [num_blocks, block_size, 2, kv_heads, head_dim] (K at index 0, V at 1),
so a block of one layer is one contiguous run of memory and a gather by block id is cheap.
The tensors live on the engine's device; blocks copied out (`read_blocks`) are always on
the CPU, for the KV transfer to ship as bytes, and blocks copied in may come from anywhere.
On the CPU the layers are views of one allocation on 2 MiB pages where the kernel gives them
(huge_pages.py: the decode attention's reads miss the TLB far less), a fresh mapping whose
pages the kernel zeroes as they are first written: the start does not wait for that.
"""

from __future__ import annotations

import logging

import torch

from shared.engine.errors import InvalidRequest
from shared.engine.huge_pages import fresh_zeros_on_huge_pages, thp_mode
from shared.engine.model_config import ModelConfig

CPU = torch.device("cpu")

log = logging.getLogger(__name__)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device = CPU,
    ) -> None:
        self.block_shape = (block_size, 2, config.num_kv_heads, config.head_dim)
        self.dtype = dtype
        self.device = device
        shape = (num_blocks, *self.block_shape)
        if device.type == "cpu":
            every_layer, advised = fresh_zeros_on_huge_pages((config.num_layers, *shape), dtype)
            self.layers = list(every_layer.unbind(0))
            log.info(
                "KV cache: %d MiB, %s (transparent huge pages: %s)",
                every_layer.nbytes >> 20,
                "2 MiB pages asked for" if advised else "4 KiB pages",
                thp_mode(),
            )
        else:
            self.layers = [
                torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
            ]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        per_layer = block_size * 2 * config.num_kv_heads * config.head_dim
        return per_layer * config.num_layers * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def blocks_in(gib: float, block_size: int, dtype: torch.dtype, *models: ModelConfig) -> int:
        """Blocks `gib` of memory holds, each with every one of `models`' layers (a draft
        model's beside the target's)."""
        per_block = sum(KVCache.bytes_per_block(m, block_size, dtype) for m in models)
        return int(gib * 2**30 // per_block)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def read_blocks(self, block_ids: list[int], layers: range) -> torch.Tensor:
        """A CPU copy of the blocks: [len(layers), len(block_ids), block_size, 2, kv_heads, d].
        Gathered straight into one tensor: a stack of per-layer gathers copied twice, into
        fresh allocations, and cost several times more per block (docs/kv_tier.md)."""
        index = torch.tensor(block_ids, dtype=torch.int64).to(self.device)
        shape = (len(layers), len(block_ids), *self.block_shape)
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        for offset, layer in enumerate(layers):
            torch.index_select(self.layers[layer], 0, index, out=out[offset])
        return out.cpu()

    def write_blocks(self, block_ids: list[int], layers: range, data: torch.Tensor) -> None:
        """data: as `read_blocks` returns. Data or layers that do not fit are the sender's
        fault (InvalidRequest, field kv); block ids are the engine's own."""
        expected = (len(layers), len(block_ids), *self.block_shape)
        if tuple(data.shape) != expected or data.dtype != self.dtype:
            reason = (
                f"KV blocks of shape {tuple(data.shape)} {data.dtype} do not fit "
                f"{expected} {self.dtype}"
            )
            raise InvalidRequest("kv", reason)
        if layers.start < 0 or layers.stop > self.num_layers:
            raise InvalidRequest("kv", f"layers {layers} outside [0, {self.num_layers})")
        num_blocks = self.layers[0].shape[0]
        assert all(0 <= b < num_blocks for b in block_ids), f"block ids outside [0, {num_blocks})"
        index = torch.tensor(block_ids, dtype=torch.int64).to(self.device)
        data = data.to(self.device)  # one host-to-device copy for all the layers
        for offset, layer in enumerate(layers):
            self.layers[layer].index_copy_(0, index, data[offset])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every layer (copy-on-write after a fork)."""
        for layer in self.layers:
            for src, dst in pairs:
                layer[dst].copy_(layer[src])
