"""What every one-sided transport checks and plans before a READ moves a byte.

`check_cache` validates a worker's own cache tensors against its `KVLayout`; `check_read`
refuses a READ whose block ids do not fit both caches; `block_runs` merges the pairs into
runs that are consecutive on both sides, so one run of one layer is one descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kvtransfer.chunks import DTYPES, KVLayout


@dataclass(frozen=True, slots=True)
class BlockRun:
    remote_start: int
    local_start: int
    length: int  # blocks: remote_start + i is read into local_start + i


def check_cache(layers: list[torch.Tensor], layout: KVLayout) -> int:
    """The block count of `layers` (one [num_blocks, *layout.block_shape] tensor per layer,
    contiguous, of layout's dtype, all on one device); ValueError when they do not fit."""
    if len(layers) != layout.num_layers:
        raise ValueError(f"{len(layers)} cache tensors, the layout has {layout.num_layers} layers")
    num_blocks = layers[0].shape[0]
    for index, layer in enumerate(layers):
        if list(layer.shape) != [num_blocks, *layout.block_shape]:
            raise ValueError(f"layer {index} is {list(layer.shape)}, not [blocks, *block_shape]")
        if layer.dtype != DTYPES[layout.dtype] or not layer.is_contiguous():
            raise ValueError(f"layer {index} must be a contiguous {layout.dtype} tensor")
        if layer.device != layers[0].device:
            raise ValueError(f"layer {index} is on {layer.device}, layer 0 on {layers[0].device}")
    return num_blocks


def check_read(
    remote_blocks: list[int], local_blocks: list[int], remote_count: int, local_count: int
) -> None:
    """ValueError unless the lists pair up, every id is within its cache, and no local block
    is written twice (which would leave its contents up to the order of the writes)."""
    if len(remote_blocks) != len(local_blocks):
        raise ValueError(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones")
    sides = (("remote", remote_blocks, remote_count), ("local", local_blocks, local_count))
    for side, ids, count in sides:
        bad = [i for i in ids if not 0 <= i < count]
        if bad:
            raise ValueError(f"{side} block ids {bad[:4]} outside [0, {count})")
    if len(set(local_blocks)) != len(local_blocks):
        raise ValueError("a local block appears twice")


def block_runs(remote_blocks: list[int], local_blocks: list[int]) -> list[BlockRun]:
    """Pairs in order, merged where both ids go up by one: [3,7,8,9]→[0,1,2,5] is
    (3→0), (7→1 ×2), (9→5)."""
    runs: list[BlockRun] = []
    for remote, local in zip(remote_blocks, local_blocks, strict=True):
        last = runs[-1] if runs else None
        if (
            last
            and remote == last.remote_start + last.length
            and (local == last.local_start + last.length)
        ):
            runs[-1] = BlockRun(last.remote_start, last.local_start, last.length + 1)
        else:
            runs.append(BlockRun(remote, local, 1))
    return runs
