"""`StackedPair`: one fused matrix's adapters in every slot, laid out as one call reads them
for a whole step (csrc/cpu/lora_products.cpp's `lora_add`, as punica's SGMV or vLLM's
sgmv shrink/expand), and `HostPair`, one adapter's share in that layout on the host.

Per slot: a [M, P, K, 16], module m's A as P panels of 16 ranks, k-major (P: max_lora_rank
over 16, rounded up); b [C, 16 P, 16], the output columns as C panels of 16 — each module's
columns begin a panel of their own — rank-major; ranks [M] int32 (0: a module the adapter
leaves alone). A slot is filled by copying an adapter's host layout over it whole, so no bit
of the adapter it replaces stays.

The one rule: on a CPU with the C++ kernels every product is `lora_add`'s, batch-invariant (a
row's bits never depend on the other rows of its step); elsewhere the same layout runs
through torch, right but not batch-invariant (as the base's torch matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from types import ModuleType

import torch

from shared.engine import native
from shared.engine.huge_pages import zeros_on_huge_pages
from shared.engine.lora.checkpoint import LowRankPair

LANES = 16  # ranks per A panel, columns per B panel
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True, frozen=True)
class HostPair:
    """One adapter's share of one fused matrix, as a slot holds it."""

    a: torch.Tensor  # [M, P, K, 16]
    b: torch.Tensor  # [C, 16 P, 16]
    ranks: torch.Tensor  # [M] int32


def lay_out(pair: LowRankPair, edges: tuple[int, ...], rank_panels: int) -> HostPair:
    """`pair` (A [M, r, K], B [N, r]) in the slots' layout; zeros pad every rank and column."""
    modules, rank, k = pair.a.shape
    width = rank_panels * LANES
    a = pair.a.new_zeros(modules, width, k)
    a[:, :rank] = pair.a
    a = a.view(modules, rank_panels, LANES, k).transpose(2, 3)  # [M, P, K, 16]
    panels = []
    for first, stop in pairwise(edges):
        cols = _panels(stop - first) * LANES
        block = pair.b.new_zeros(cols, width)
        block[: stop - first, :rank] = pair.b[first:stop]
        panels.append(block.view(cols // LANES, LANES, width).transpose(1, 2))  # [c, 16 P, 16]
    ranks = torch.tensor([rank if on else 0 for on in pair.present], dtype=torch.int32)
    return HostPair(a.contiguous(), torch.cat(panels).contiguous(), ranks)


class StackedPair:
    def __init__(
        self,
        slots: int,
        edges: tuple[int, ...],  # module row bounds (targets.module_bounds)
        in_features: int,
        rank_panels: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.edges = edges
        modules, columns = len(edges) - 1, sum(_panels(b - a) for a, b in pairwise(edges))
        self.a = _zeros((slots, modules, rank_panels, in_features, LANES), dtype, device)
        self.b = _zeros((slots, columns, rank_panels * LANES, LANES), dtype, device)
        self.ranks = torch.zeros(slots, modules, dtype=torch.int32)  # on the host: read there
        self.bounds = torch.tensor(edges, dtype=torch.int64)
        kernels = native.load() if device.type == "cpu" and dtype in _KERNEL_DTYPES else None
        self._kernels: ModuleType | None = kernels

    @property
    def slot_bytes(self) -> int:
        return self.a[0].nbytes + self.b[0].nbytes

    def fill(self, slot: int, host: HostPair | None) -> None:
        """Put an adapter's share in `slot` (None: it leaves this matrix alone)."""
        if host is None:
            self.ranks[slot] = 0
            return
        self.a[slot].copy_(host.a)
        self.b[slot].copy_(host.b)
        self.ranks[slot].copy_(host.ranks)

    def add(
        self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, interleave: int = 0
    ) -> torch.Tensor:
        """y [T, N] += each row's adapter product of x [T, K], in place; slots [T] int32 on
        the host, -1 for the base model's rows. interleave: 0, or y holds the modules in
        turns of that many columns (a PackedGateUp's product: lora_products.h). Returns y."""
        if self._kernels is not None and x.dtype in _KERNEL_DTYPES and y.dtype in _KERNEL_DTYPES:
            x = x if x.stride(-1) == 1 else x.contiguous()
            self._kernels.lora_add(y, x, slots, self.a, self.b, self.ranks, self.bounds, interleave)
            return y
        return self.add_by_torch(x, y, slots, interleave)

    def add_by_torch(
        self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, interleave: int = 0
    ) -> torch.Tensor:
        """`add` through torch's matmuls: off the CPU kernels (or their dtypes)."""
        on_device = slots.to(y.device)
        for slot in sorted(set(slots.tolist()) - {-1}):
            ranks = self.ranks[slot].tolist()
            rows = (on_device == slot).nonzero().squeeze(1)
            a, b = self.a[slot].float(), self.b[slot].float()
            u = torch.einsum("rk,mpkl->rmpl", x[rows].float(), a).flatten(2)  # [n, M, 16 P]
            column = 0
            for m, (first, stop) in enumerate(pairwise(self.edges)):
                count = _panels(stop - first)
                if ranks[m]:
                    product = torch.einsum("rj,cjl->rcl", u[:, m], b[column : column + count])
                    columns = self._columns(m, interleave).to(y.device)
                    product = product.flatten(1)[:, : stop - first].to(y.dtype)
                    y[rows[:, None], columns] += product
                column += count
        return y

    def _columns(self, m: int, interleave: int) -> torch.Tensor:
        """y's columns of module m (lora_products.h's interleave)."""
        first, stop = self.edges[m], self.edges[m + 1]
        own = torch.arange(stop - first)
        if not interleave:
            return own + first
        modules = len(self.edges) - 1
        return own // interleave * interleave * modules + m * interleave + own % interleave


def _panels(columns: int) -> int:
    return -(-columns // LANES)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Slots read every step: on 2 MiB pages on the host, as the base's weights."""
    if device.type == "cpu":
        return zeros_on_huge_pages(shape, dtype)[0]
    return torch.zeros(shape, dtype=dtype, device=device)
