"""Host tensors on 2 MiB pages, where Linux's transparent huge pages are offered on request.

The decode attention reads every running sequence's KV blocks each step, hundreds of MB
scattered over the cache; on 4 KiB pages that is a TLB miss every 4 KiB. With the kernel's
THP mode `madvise` (the usual default), memory gets 2 MiB pages only where a process asks for
them with madvise(MADV_HUGEPAGE) before it first touches the pages. `zeros_on_huge_pages`
allocates, asks over the 2 MiB-aligned part, then zeroes (the faults then take huge pages
when the kernel has free ones: with memory fragmented it falls back to 4 KiB pages; a
process's AnonHugePages in /proc/PID/smaps say what it got). `fresh_zeros_on_huge_pages`
(the KV cache's) asks the same of a fresh mapping and touches nothing: the advice holds for
the faults to come, so the pages are huge ones however late they are first written, and a
start does not wait for the zeroing (the kernel zeroes each page at its first write).

The weights stream through the matmuls every step: `move_onto_huge_pages` puts a model's
tensors in one such allocation (torch's THP_MEM_ALLOC_ENABLE advises only allocations of 2 MiB
or more, which leaves a small model's matrices on 4 KiB pages). What each saves:
docs/engine-speed.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import mmap
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_PAGE = 4096
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

log = logging.getLogger(__name__)


def thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise, never, or unavailable."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def empty_on_huge_pages(nbytes: int) -> tuple[torch.Tensor, bool]:
    """(`nbytes` of uninitialized CPU memory as uint8, starting on a 2 MiB boundary, not yet
    touched; whether the kernel took the request for huge pages in a mode that gives them, if
    it has free ones). Small sizes and other systems get plain pages."""
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE or thp_mode() not in ("always", "madvise"):
        return torch.empty(nbytes, dtype=torch.uint8), False
    # untouched: not yet faulted in; room for the 2 MiB start and the last page's end
    raw = torch.empty(nbytes + HUGE_PAGE + _PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    advised = madvise(raw.data_ptr() + offset, -(-nbytes // _PAGE) * _PAGE, _MADV_HUGEPAGE) == 0
    if not advised:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return raw[offset : offset + nbytes], advised


def fresh_zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, bool]:
    """As `zeros_on_huge_pages`, without touching a page: fresh anonymous memory of its own
    mapping, which the kernel promises reads zero, faulted in (on huge pages, where it
    gives them) as it is first written. Memory a tensor takes from torch's allocator may be
    reused, so only a mapping of its own is zero untouched."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    huge = madvise is not None and nbytes >= HUGE_PAGE and thp_mode() in ("always", "madvise")
    # anonymous and private (mmap's default is shared: shmem, whose pages MADV_DONTNEED does
    # not free): zero; room for the 2 MiB start where huge pages are asked for
    length = max(_PAGE, nbytes + (HUGE_PAGE if huge else 0))
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while it lives
    offset = -raw.data_ptr() % HUGE_PAGE if huge else 0
    advised = False
    if huge:
        advised = madvise(raw.data_ptr() + offset, -(-nbytes // _PAGE) * _PAGE, _MADV_HUGEPAGE) == 0
    return raw[offset : offset + nbytes].view(dtype).view(shape), advised


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(a zeroed CPU tensor of `shape`, contiguous, starting on a 2 MiB boundary; whether the
    kernel took the request for huge pages: as `empty_on_huge_pages`)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw, advised = empty_on_huge_pages(nbytes)
    return raw.view(dtype).view(shape).zero_(), advised


def tensors_in(value: object) -> Iterator[torch.Tensor]:
    """Every tensor in `value`: itself, or inside its dataclass fields, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))


def move_onto_huge_pages(tensors: Iterator[torch.Tensor]) -> tuple[int, bool]:
    """Move the memory of the CPU tensors into one allocation on 2 MiB pages, in place: each
    tensor keeps its identity, shape, strides and values, and tensors that shared memory
    still do (a tied head and embedding). Returns (bytes moved, whether huge pages were
    asked for); nothing moves where the kernel offers none."""
    # storage -> (it, the tensors over it once each): a storage moves once, all its tensors with it
    groups: dict[int, tuple[torch.UntypedStorage, dict[int, torch.Tensor]]] = {}
    for tensor in tensors:
        if tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            groups.setdefault(storage.data_ptr(), (storage, {}))[1][id(tensor)] = tensor
    # each storage at a 64-byte boundary: any element type's offset stays whole
    sizes = [-(-storage.nbytes() // 64) * 64 for storage, _ in groups.values()]
    arena, advised = empty_on_huge_pages(sum(sizes))
    if not advised:
        return 0, False
    start = 0
    for key, size in zip(list(groups), sizes, strict=True):
        storage, sharing = groups.pop(key)  # the old storage let go once copied: no 2x peak
        arena[start : start + storage.nbytes()].copy_(
            torch.empty(0, dtype=torch.uint8).set_(storage)
        )
        del storage
        for tensor in sharing.values():
            tensor.set_(
                arena.untyped_storage(),
                (arena.storage_offset() + start) // tensor.element_size() + tensor.storage_offset(),
                tensor.shape,
                tensor.stride(),
            )
        start += size
    return start, True
