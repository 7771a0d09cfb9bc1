"""The KV cache and the weights on 2 MiB pages (shared/engine/huge_pages.py): zeroed, aligned,
advised for huge pages where the kernel offers them (the advice read back from
/proc/self/smaps; whether the kernel has free huge pages to give is its call), each KV layer
its own run of memory, and moved weights the same tensors with the same values."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from shared.engine.huge_pages import (
    HUGE_PAGE,
    move_onto_huge_pages,
    tensors_in,
    thp_mode,
    zeros_on_huge_pages,
)
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


@dataclass
class _Holder:
    matrix: torch.Tensor
    pieces: list[torch.Tensor]


@pytest.mark.skipif(not OFFERED, reason="the kernel offers no transparent huge pages")
def test_moved_weights_keep_identity_values_and_shared_memory() -> None:
    base = torch.randn(3000, 700)  # ~8 MiB
    tied = torch.randn(512, 64).to(torch.bfloat16)
    view = base[100:200, 5:]  # an offset, strided view of base's memory
    holder = _Holder(base, [view, tied, tied, torch.arange(7, dtype=torch.int64)])
    before = [t.clone() for t in (base, view, tied, holder.pieces[3])]
    moved, advised = move_onto_huge_pages(tensors_in(holder))
    assert advised and moved >= base.nbytes + tied.nbytes
    after = (holder.matrix, holder.pieces[0], holder.pieces[1], holder.pieces[3])
    assert holder.matrix is base and holder.pieces[0] is view and holder.pieces[2] is tied
    for old, new in zip(before, after, strict=True):
        assert new.dtype == old.dtype and torch.equal(new, old)
    assert view.stride() == (700, 1) and not view.is_contiguous()
    assert "hg" in _flags_behind(base) and "hg" in _flags_behind(tied)
    base[150, 10] = 42.0  # the view still looks at base's memory
    assert view[50, 5] == 42.0
    assert tied.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # one arena


def test_nothing_moves_below_a_huge_page() -> None:
    small = torch.randn(16, 16)
    pointer = small.data_ptr()
    assert move_onto_huge_pages(tensors_in([small])) == (0, False)
    assert small.data_ptr() == pointer
