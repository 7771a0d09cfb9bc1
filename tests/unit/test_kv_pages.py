"""The KV pool's memory (shared/engine/huge_pages.py `fresh_zeros_on_huge_pages`): allocated
without touching a page (none resident, by mincore), zero, on a 2 MiB boundary and advised
for huge pages where the kernel offers them; a write faults in only the pages it reaches;
sleep level 1's hand-back frees them again (a private mapping: a shared one's pages would
stay in memory); the KV cache's pool is such memory."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import torch

from shared.engine.huge_pages import HUGE_PAGE, fresh_zeros_on_huge_pages, thp_mode
from shared.engine.kv_cache import KVCache
from shared.engine.sleep_mode import give_back
from tests.unit.test_machine_share import TINY

PAGE = 4096
SHAPE = (64, 1024, 256)  # 64 MiB of float32
OFFERED = thp_mode() in ("always", "madvise")


def resident_pages(tensor: torch.Tensor) -> int:
    """How many of the tensor's pages are in memory (mincore), without touching them."""
    start = tensor.data_ptr() // PAGE * PAGE
    length = tensor.data_ptr() + tensor.nbytes - start
    vector = (ctypes.c_ubyte * -(-length // PAGE))()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert mincore(start, length, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector)


def test_a_fresh_tensor_is_untouched_zero_and_advised() -> None:
    tensor, advised = fresh_zeros_on_huge_pages(SHAPE, torch.float32)
    assert tuple(tensor.shape) == SHAPE and tensor.is_contiguous()
    assert resident_pages(tensor) == 0  # nothing zeroed at allocation
    assert advised == OFFERED
    if advised:
        assert tensor.data_ptr() % HUGE_PAGE == 0
    assert not tensor.any()
    small, advised = fresh_zeros_on_huge_pages((3, 5), torch.bfloat16)
    assert not advised and not small.any()


def test_a_write_faults_in_what_it_reaches_and_a_hand_back_frees_it() -> None:
    tensor, _ = fresh_zeros_on_huge_pages(SHAPE, torch.float32)
    tensor[3, 7, :5] = torch.arange(1.0, 6.0)
    in_memory = resident_pages(tensor)
    assert 0 < in_memory <= HUGE_PAGE // PAGE  # one page: a 2 MiB one, or 4 KiB
    assert tensor[3, 7, :5].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert int(tensor.count_nonzero()) == 5
    give_back(tensor)
    assert resident_pages(tensor) == 0
    assert not tensor.any()


def test_the_kv_cache_pool_starts_untouched() -> None:
    config = replace(TINY, num_layers=2, head_dim=32)
    cache = KVCache(config, num_blocks=256, block_size=16, dtype=torch.float32)
    assert all(resident_pages(layer) == 0 for layer in cache.layers)
    assert all(not layer.any() for layer in cache.layers)
