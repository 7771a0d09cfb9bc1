"""`AdapterBank`: the adapters one engine serves, from the name a request gives to the
matrices its rows are multiplied by.

Three tiers, each LRU: known (name -> directory: `--lora-modules` and loads at run time),
host (read, checked and laid out as the matmuls read them — packed beside packed base
weights —: `max_cpu_loras`) and slots (on the engine's device: `max_loras`; on a CPU a slot
is the host copy itself, so a swap-in costs nothing). A step names its adapters
(`begin_step`); those not in a slot are filled, evicting the least recently used slot that
the step does not need.

The one rule: the scheduler lets no step use more adapters than there are slots
(BatchScheduler's `max_adapters`), so `begin_step` never has to evict a slot its own step
needs; an adapter is read (and so checked) when it is loaded, before any request may name it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.engine.errors import BadAdapter
from shared.engine.lora.checkpoint import read_adapter
from shared.engine.lora.step_rows import StepRows
from shared.engine.lora.targets import Target
from shared.engine.model.linear_weights import PackedLinear
from shared.engine.model_config import ModelConfig

LowRank = torch.Tensor | PackedLinear
SlotLayer = dict[Target, tuple[LowRank, LowRank]]  # fused matrix -> (A, B) as the matmul reads


@dataclass(slots=True)
class BankStats:
    """Since start."""

    reads: int = 0  # adapters read from disk (loads, and re-reads after host eviction)
    swap_ins: int = 0  # slots filled
    swap_in_seconds: float = 0.0  # spent filling them


@dataclass(slots=True, frozen=True)
class BankLimits:
    max_loras: int  # slots
    max_rank: int
    host_slots: int  # max_cpu_loras


class AdapterBank:
    def __init__(
        self,
        config: ModelConfig,
        limits: BankLimits,
        dtype: torch.dtype,
        device: torch.device,
        packed: bool,  # the base's matrices are PackedLinear: so are the adapters'
    ) -> None:
        self.config = config
        self.limits = limits
        self.dtype = dtype
        self.device = device
        self.packed = packed
        self.paths: dict[str, Path] = {}  # every adapter a request may name
        self.stats = BankStats()
        self._host: OrderedDict[str, list[SlotLayer]] = OrderedDict()
        self._slots: OrderedDict[str, list[SlotLayer]] = OrderedDict()
        self._step: StepRows | None = None

    # -- adapters in and out ------------------------------------------------------------------
    def load(self, name: str, path: Path) -> None:
        """Read and check the adapter (BadAdapter saying why not), then know it by `name`.
        Loading a known name again reads it afresh (a new checkpoint at the path)."""
        layers = self._read(name, path)
        self.unload(name)
        self.paths[name] = path
        self._keep_on_host(name, layers)

    def unload(self, name: str) -> None:
        self.paths.pop(name, None)
        self._host.pop(name, None)
        self._slots.pop(name, None)

    def knows(self, name: str) -> bool:
        return name in self.paths

    @property
    def in_slots(self) -> list[str]:
        return list(self._slots)

    # -- one step -------------------------------------------------------------------------------
    def begin_step(self, rows: StepRows) -> None:
        """Fill a slot for every adapter of the step, then serve its rows' products."""
        needed = rows.adapters
        if len(needed) > self.limits.max_loras:
            limit = self.limits.max_loras
            raise RuntimeError(f"a step uses {len(needed)} adapters; max_loras is {limit}")
        for name in needed:
            if name in self._slots:
                self._slots.move_to_end(name)
                continue
            while len(self._slots) >= self.limits.max_loras:
                victim = next(n for n in self._slots if n not in needed)
                del self._slots[victim]
            self._slots[name] = self._fill_slot(name)
        self._step = rows

    def add_products(self, x: torch.Tensor, y: torch.Tensor, layer: int, target: Target):
        """y [n, out] += each adapter's B(A(x)) on its rows of x [n, in]; returns y."""
        if self._step is None:
            return y
        for group in self._step.groups(x.shape[0]):
            pair = self._slots[group.adapter][layer].get(target)
            if pair is None:
                continue
            a, b = pair
            for rows in group.slices:
                y[rows] += _matmul(_matmul(x[rows], a), b).to(y.dtype)  # [n, R] -> [n, out]
        return y

    # -- internals ----------------------------------------------------------------------------
    def _read(self, name: str, path: Path) -> list[SlotLayer]:
        self.stats.reads += 1
        weights = read_adapter(name, path, self.config, self.limits.max_rank, self.dtype)
        return [
            {target: (self._lay_out(a), self._lay_out(b)) for target, (a, b) in layer.items()}
            for layer in weights.layers
        ]

    def _keep_on_host(self, name: str, layers: list[SlotLayer]) -> None:
        self._host[name] = layers
        self._host.move_to_end(name)
        while len(self._host) > self.limits.host_slots:
            self._host.popitem(last=False)

    def _fill_slot(self, name: str) -> list[SlotLayer]:
        started = time.perf_counter()
        layers = self._host.get(name)
        if layers is None:  # evicted from the host: read again (it was checked at load)
            try:
                layers = self._read(name, self.paths[name])
            except BadAdapter as exc:
                reason = f"adapter {name!r} changed on disk since it was loaded: {exc}"
                raise RuntimeError(reason) from None
            self._keep_on_host(name, layers)
        else:
            self._host.move_to_end(name)
        slot = [
            {target: (self._to_device(a), self._to_device(b)) for target, (a, b) in layer.items()}
            for layer in layers
        ]
        self.stats.swap_ins += 1
        self.stats.swap_in_seconds += time.perf_counter() - started
        return slot

    def _lay_out(self, w: torch.Tensor) -> LowRank:
        """The host copy: packed for the kernel beside packed base weights, else as read."""
        return PackedLinear.pack(w) if self.packed else w

    def _to_device(self, w: LowRank) -> LowRank:
        """A slot's copy: the host's own on a CPU (packed weights are only ever there)."""
        return w if isinstance(w, PackedLinear) else w.to(self.device)


def _matmul(x: torch.Tensor, w: LowRank) -> torch.Tensor:
    """x [n, K] -> [n, N]: the packed kernel (fp32 out, batch-invariant) or torch's."""
    if isinstance(w, PackedLinear):
        return w(x, None, float_out=True)
    return F.linear(x, w.to(x.dtype))
