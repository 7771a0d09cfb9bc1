"""The KV cache on 2 MiB pages (shared/engine/huge_pages.py): zeroed, aligned, advised for huge
pages where the kernel offers them (the advice read back from /proc/self/smaps; whether the
kernel has free huge pages to give is its call), and each layer its own run of memory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.engine.huge_pages import HUGE_PAGE, thp_mode, zeros_on_huge_pages
from shared.engine.kv_cache import KVCache
from tests.unit.test_machine_share import TINY

OFFERED = thp_mode() in ("always", "madvise")
SHAPE = (3, 1000, 16, 2, 3, 64)  # ~35 MiB of bf16


def _flags_behind(tensor: torch.Tensor) -> set[str]:
    """The VmFlags (/proc/self/smaps) every mapping behind the tensor's bytes has."""
    first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    behind: list[set[str]] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if not head.endswith(":"):  # "start-end perms offset dev inode [path]"
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start < last and first < end
        elif head == "VmFlags:" and inside:
            behind.append(set(line.split()[1:]))
    assert behind, "no mapping holds the tensor"
    return set.intersection(*behind)


def test_a_big_tensor_is_zeroed_contiguous_and_starts_on_a_huge_page() -> None:
    tensor, advised = zeros_on_huge_pages(SHAPE, torch.bfloat16)
    assert tuple(tensor.shape) == SHAPE and tensor.dtype == torch.bfloat16
    assert tensor.is_contiguous() and not tensor.any()
    assert advised == OFFERED
    if advised:
        assert tensor.data_ptr() % HUGE_PAGE == 0
        assert "hg" in _flags_behind(tensor), "madvise(MADV_HUGEPAGE) did not reach the pages"


def test_a_small_tensor_takes_plain_pages() -> None:
    tensor, advised = zeros_on_huge_pages((4, 8), torch.float32)
    assert not advised and tuple(tensor.shape) == (4, 8) and not tensor.any()


@pytest.mark.skipif(not OFFERED, reason="the kernel offers no transparent huge pages")
def test_kv_cache_layers_are_separate_views_of_one_advised_allocation() -> None:
    config = replace(TINY, num_layers=3, head_dim=32)  # 2 KV heads
    cache = KVCache(config, num_blocks=2048, block_size=16, dtype=torch.float32)
    first, *rest = cache.layers
    assert first.data_ptr() % HUGE_PAGE == 0 and "hg" in _flags_behind(first)
    assert all(layer.shape == (2048, 16, 2, 2, 32) and layer.is_contiguous() for layer in rest)
    cache.layers[1].fill_(1.0)  # one layer's writes stay in that layer
    assert not cache.layers[0].any() and not cache.layers[2].any()
    blocks = cache.read_blocks([5, 7], range(0, 3))
    assert blocks[1].eq(1.0).all() and not blocks[0].any() and not blocks[2].any()
