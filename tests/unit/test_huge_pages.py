"""The KV cache on 2 MiB pages (shared/engine/huge_pages.py): zeroed, aligned, backed by huge
pages where the kernel offers them, and each layer its own run of memory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.engine.huge_pages import HUGE_PAGE, thp_mode, zeros_on_huge_pages
from shared.engine.kv_cache import KVCache
from tests.unit.test_machine_share import TINY

OFFERED = thp_mode() in ("always", "madvise")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_big_tensor_is_zeroed_contiguous_and_starts_on_a_huge_page() -> None:
    shape = (3, 1000, 16, 2, 3, 64)  # ~35 MiB of bf16
    tensor, huge = zeros_on_huge_pages(shape, torch.bfloat16)
    assert tuple(tensor.shape) == shape and tensor.dtype == torch.bfloat16
    assert tensor.is_contiguous() and not tensor.any()
    assert huge == OFFERED
    if huge:
        assert tensor.data_ptr() % HUGE_PAGE == 0
        assert _anon_huge_kib(tensor.data_ptr()) >= 8 * 1024, "expected 2 MiB pages behind it"


def test_a_small_tensor_takes_plain_pages() -> None:
    tensor, huge = zeros_on_huge_pages((4, 8), torch.float32)
    assert not huge and tuple(tensor.shape) == (4, 8) and not tensor.any()


@pytest.mark.skipif(not OFFERED, reason="the kernel offers no transparent huge pages")
def test_kv_cache_layers_are_separate_views_of_one_huge_page_allocation() -> None:
    config = replace(TINY, num_layers=3, head_dim=32)  # 2 KV heads
    cache = KVCache(config, num_blocks=2048, block_size=16, dtype=torch.float32)
    first, *rest = cache.layers
    assert first.data_ptr() % HUGE_PAGE == 0
    assert all(layer.shape == (2048, 16, 2, 2, 32) and layer.is_contiguous() for layer in rest)
    cache.layers[1].fill_(1.0)  # one layer's writes stay in that layer
    assert not cache.layers[0].any() and not cache.layers[2].any()
    blocks = cache.read_blocks([5, 7], range(0, 3))
    assert blocks[1].eq(1.0).all() and not blocks[0].any() and not blocks[2].any()
