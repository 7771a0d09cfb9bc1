"""Sleep and wake-up of an idle engine (vLLM's sleep levels): level 1 gives back the KV
pool's memory, level 2 the weights too; waking up brings back what was given back.

The KV pool stays where it is: its pages are handed back to the kernel (madvise
MADV_DONTNEED), which maps zero pages back in as they are touched again, so the tensors, their
addresses and a transport's registration of them (NIXL) all hold across the sleep and
waking up from level 1 costs nothing. The subtle rule: the pool's contents are gone, so
the prefix cache is forgotten first (its blocks reported removed, as KV events say), and
only an engine that holds no block may sleep. Weights are dropped with the model and
loaded again (weights load and packing) on waking up from level 2.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.errors import EngineError
from shared.engine.model_runner import ModelRunner

MADV_DONTNEED = 4  # <sys/mman.h>, Linux
PAGE = os.sysconf("SC_PAGE_SIZE")


def put_to_sleep(blocks: BlockManager, runners: Sequence[ModelRunner], level: int) -> None:
    """EngineError when a block is in use (a request, a held or reserved hand-off)."""
    if level not in (1, 2):
        raise EngineError(f"sleep level {level}: 1 (the KV pool) or 2 (the weights too)")
    if any(runner.device.type != "cpu" for runner in runners):
        raise EngineError("the native engine sleeps on a CPU only")
    blocks.forget_cached()
    if blocks.num_free_blocks != blocks.num_blocks:
        in_use = blocks.num_blocks - blocks.num_free_blocks
        raise EngineError(f"{in_use} KV blocks in use: drain the engine before it sleeps")
    for runner in runners:
        for layer in runner.kv_cache.layers:
            give_back(layer)
        if level == 2:
            runner.release_weights()


def wake_up(runners: Sequence[ModelRunner]) -> None:
    for runner in runners:
        if not runner.has_weights:
            runner.load_model()


def give_back(tensor: torch.Tensor) -> None:
    """Hand the whole pages of `tensor`'s memory back to the kernel (it reads zeros after)."""
    start = tensor.data_ptr()
    end = start + tensor.nbytes
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last <= first:
        return
    if _madvise(first, last - first, MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
    partial = [(start, first - start), (last, end - last)]  # the rest of its first and last page
    for address, size in partial:
        if size > 0:
            ctypes.memset(address, 0, size)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int
