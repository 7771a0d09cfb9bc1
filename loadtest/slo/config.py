"""What one `splitserve bench slo` run is asked (`SloBenchConfig`), and the configurations
it compares: each a list of pinned pools (`Configuration`), its cost the cores it holds.

`--configs "split=prefill:0,decode:1;aggregated=both:0-1;two=both:0,both:1"`: configurations
split by `;`, each `NAME=POOLS`, the pools read as `splitserve up --pool` reads them
(services/launch_plan.py: parse_pools). A vLLM-CPU peer row (`--peer vllm`) is a
configuration too, of server "vllm": one per distinct core set, on the cores of that set.

The one subtle rule: everything is checked when the config is made (names, pools, rates,
SLO, workloads), so a bad flag stops the run before any server starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.slo.attainment import Slo
from services.launch_plan import PinnedPool, parse_pools
from services.worker.pinning import cpu_list
from shared.errors import ConfigError
from shared.models.registry import DEFAULT_MODEL

PEERS = ("vllm",)
SHIFT_KINDS = ("chat", "long", "gen")  # what a shift phase can be (workloads.py)
WORKLOADS = ("chat", "long", "gen", "agent", "mixed", "mooncake", "shift")  # made by workloads.py


@dataclass(frozen=True, slots=True)
class Configuration:
    name: str
    pools: tuple[PinnedPool, ...]
    server: str = "splitserve"  # or "vllm": vLLM-CPU on the pools' cores, one server

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(c for pool in self.pools for c in pool.cpus))

    @property
    def cost(self) -> int:
        """Its hardware: the cores it holds."""
        return len(self.cpus)

    def up_args(self) -> tuple[str, ...]:
        """`splitserve up`'s flags for these pools: `--pool ROLE:CPUS` each."""
        return tuple(arg for pool in self.pools for arg in ("--pool", str(pool)))

    def as_json(self) -> dict[str, object]:
        pools = [{"role": p.role, "cpus": list(p.cpus)} for p in self.pools]
        return {
            "name": self.name,
            "server": self.server,
            "pools": pools,
            "cpus": list(self.cpus),
            "cost": self.cost,
        }


def parse_configs(text: str) -> tuple[Configuration, ...]:
    """`split=prefill:0,decode:1;aggregated=both:0-1` → configurations; ConfigError naming
    the part that is wrong."""
    configs: list[Configuration] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, equals, pools = (s.strip() for s in part.partition("="))
        if not (equals and name and pools):
            raise ConfigError(f"--configs: {part!r}: expected NAME=ROLE:CPUS,...")
        if any(c.name == name for c in configs):
            raise ConfigError(f"--configs: the name {name!r} is given twice")
        try:
            configs.append(Configuration(name, parse_pools(pools.split(","))))
        except ConfigError as exc:
            raise ConfigError(f"--configs: {name}: {exc}") from None
    if not configs:
        raise ConfigError("--configs: no configuration, e.g. split=prefill:0,decode:1")
    return tuple(configs)


def peer_rows(configs: tuple[Configuration, ...], peer: str) -> tuple[Configuration, ...]:
    """One `peer` row per distinct core set of `configs`, on those cores."""
    core_sets = dict.fromkeys(c.cpus for c in configs)  # in order, once each
    return tuple(
        Configuration(f"{peer}@{cpu_list(cpus)}", (PinnedPool("both", cpus),), server=peer)
        for cpus in core_sets
    )


def parse_rates(text: str) -> tuple[float, ...]:
    """`0.25,0.5,1,2` → ascending request rates (per second); ConfigError otherwise."""
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError as exc:
        raise ConfigError(f"--rates {text!r}: {exc}") from None
    if not rates or min(rates) <= 0 or not all(map(math.isfinite, rates)):
        raise ConfigError(f"--rates {text!r}: give positive, finite request rates")
    if len(set(rates)) != len(rates):
        raise ConfigError(f"--rates {text!r}: a rate is given twice")
    return tuple(sorted(rates))


@dataclass(frozen=True, slots=True)
class SloBenchConfig:
    configs: tuple[Configuration, ...]
    slo: Slo = field(default_factory=lambda: Slo(1.0, 0.04))
    workloads: tuple[str, ...] = WORKLOADS
    rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    num_prompts: int = 40  # per rate (shift: its phases decide)
    attainment: float = 0.9  # the share of requests that must attain the SLO
    phase_seconds: float = 120.0  # shift: the length of each phase
    phases: int = 2  # shift: chat, long, chat, ...
    long_len: int = 2048  # long (and mixed, shift): prompt tokens of a long prompt
    shift_mix: tuple[str, ...] = ("chat", "long")  # shift: each phase's kind, in turn
    seed: int = 0
    peer: str = ""  # "vllm": a vLLM-CPU row per core set; "": none
    model: str = DEFAULT_MODEL
    model_dir: Path | None = None
    up_args: tuple[str, ...] = ()  # more flags for every `splitserve up`
    peers_venv: Path = Path(".venv-peers")
    vllm_kv_cache_gib: int = 1
    start_timeout_s: float = 600.0
    request_timeout_s: float = 300.0  # past it a request is a failure
    out: Path = Path("artifacts/bench-slo")

    def __post_init__(self) -> None:
        if not self.configs:
            raise ConfigError("no configuration to run")
        unknown = sorted(set(self.workloads) - set(WORKLOADS))
        if unknown or not self.workloads:
            raise ConfigError(f"--workloads: {unknown or 'none'}; choose from {WORKLOADS}")
        if self.peer and self.peer not in PEERS:
            raise ConfigError(f"--peer {self.peer!r}: choose from {PEERS}")
        if not 0 < self.attainment <= 1:
            raise ConfigError("--attainment must be in (0, 1]")
        if self.num_prompts < 1 or self.phases < 1 or self.phase_seconds <= 0:
            raise ConfigError("--num-prompts, --phases and --phase-seconds must be positive")
        if self.long_len < 1:
            raise ConfigError("--long-len must be positive")
        if not self.shift_mix or not set(self.shift_mix) <= set(SHIFT_KINDS):
            raise ConfigError(f"--shift-mix {','.join(self.shift_mix)!r}: of {SHIFT_KINDS}")
        if not self.rates or min(self.rates) <= 0:
            raise ConfigError("the rates must be positive")

    @property
    def rows(self) -> tuple[Configuration, ...]:
        """Every configuration, then the peer's rows."""
        return self.configs + (peer_rows(self.configs, self.peer) if self.peer else ())
