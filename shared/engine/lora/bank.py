"""`AdapterBank`: the adapters one engine serves, from the name a request gives to the
matrices its rows are multiplied by.

Three tiers, each LRU: known (name -> directory: `--lora-modules` and loads at run time),
host (read, checked and laid out as the slots hold them: `max_cpu_loras`) and slots (one
index into every matrix's `StackedPair`, on the engine's device: `max_loras`; filling one
copies the adapter's host layout in). A step names its adapters (`begin_step`); those not in
a slot are filled, evicting the least recently used slot that the step does not need. Then
each matrix's products for the whole step are one call (stacked.py).

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

from shared.engine.errors import BadAdapter
from shared.engine.lora.checkpoint import read_adapter
from shared.engine.lora.stacked import LANES, HostPair, StackedPair, lay_out
from shared.engine.lora.step_rows import SlotRows, StepRows
from shared.engine.lora.targets import Target, module_bounds
from shared.engine.model_config import ModelConfig

HostLayer = dict[Target, HostPair]  # fused matrix -> the adapter's share, as a slot holds it


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
        self, config: ModelConfig, limits: BankLimits, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.limits = limits
        self.dtype = dtype
        self.paths: dict[str, Path] = {}  # every adapter a request may name
        self.stats = BankStats()
        self._host: OrderedDict[str, list[HostLayer]] = OrderedDict()
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> its slot index
        self._rows: SlotRows | None = None  # the step's
        self._rank_panels = -(-limits.max_rank // LANES)
        bounds = module_bounds(config)
        inputs = {
            Target.QKV: config.hidden_size,
            Target.O_PROJ: config.num_heads * config.head_dim,
            Target.GATE_UP: config.hidden_size,
            Target.DOWN: config.intermediate_size,
        }
        self._stacks = [
            {
                target: StackedPair(
                    limits.max_loras, bounds[target], k, self._rank_panels, dtype, device
                )
                for target, k in inputs.items()
                if target in (Target.QKV, Target.O_PROJ) or not config.is_moe_layer(layer)
            }
            for layer in range(config.num_layers)
        ]

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

    @property
    def slot_bytes(self) -> int:
        """One slot's bytes, every matrix's share at max_lora_rank: what a decode step reads
        for each adapter it uses."""
        return sum(stack.slot_bytes for stacks in self._stacks for stack in stacks.values())

    @property
    def has_rows(self) -> bool:
        """Whether the step begun last has rows of an adapter (else all are the base's)."""
        return self._rows is not None

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
            taken = set(self._slots.values())
            slot = next((i for i in range(self.limits.max_loras) if i not in taken), None)
            if slot is None:
                victim = next(n for n in self._slots if n not in needed)
                slot = self._slots.pop(victim)
            self._fill_slot(name, slot)
            self._slots[name] = slot
        self._rows = rows.slots(self._slots) if needed else None

    def add_products(
        self, x: torch.Tensor, y: torch.Tensor, layer: int, target: Target, interleave: int = 0
    ) -> torch.Tensor:
        """y [n, out] += each row's adapter product of x [n, in], in place (interleave:
        StackedPair.add's); returns y."""
        if self._rows is None:
            return y
        return self._stacks[layer][target].add(x, y, self._rows.of(x.shape[0]), interleave)

    # -- internals ----------------------------------------------------------------------------
    def _read(self, name: str, path: Path) -> list[HostLayer]:
        self.stats.reads += 1
        weights = read_adapter(name, path, self.config, self.limits.max_rank, self.dtype)
        bounds = module_bounds(self.config)
        return [
            {
                target: lay_out(pair, bounds[target], self._rank_panels)
                for target, pair in layer.items()
            }
            for layer in weights.layers
        ]

    def _keep_on_host(self, name: str, layers: list[HostLayer]) -> None:
        self._host[name] = layers
        self._host.move_to_end(name)
        while len(self._host) > self.limits.host_slots:
            self._host.popitem(last=False)

    def _fill_slot(self, name: str, slot: int) -> None:
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
        for stacks, host in zip(self._stacks, layers, strict=True):
            for target, stack in stacks.items():
                stack.fill(slot, host.get(target))
        self.stats.swap_ins += 1
        self.stats.swap_in_seconds += time.perf_counter() - started
