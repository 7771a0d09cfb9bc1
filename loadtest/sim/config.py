"""What one `splitserve bench sim` run is asked (`SimBenchConfig`) and the simulated
configurations it compares, written `--workers "prefill:8,decode:8;both:16"`.

A configuration is a list of `ROLE:COUNT` (COUNT workers of one core each) or
`ROLE:COUNTxCORES` (of CORES cores each), optionally named `NAME=...`. It becomes a
`bench slo` `Configuration` whose pools are the workers on virtual cores 0, 1, 2, ..., so
its cost is its cores and the report of loadtest/slo reads it unchanged.

The one subtle rule: `--search N` tries every split of N workers into prefill, decode and
both (counts in steps of `search_step`), never one without a worker that decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loadtest.sim.cost_model import CostModel
from loadtest.sim.mesh import MeshSettings, WorkerSpec
from loadtest.sim.planner_hook import Decider
from loadtest.slo.config import Configuration, SloBenchConfig
from services.launch_plan import PinnedPool
from shared.errors import ConfigError
from shared.protocol import ROLES

DEFAULT_VOCAB = 49152  # SmolLM2's: token ids of the workloads are drawn below it


@dataclass(frozen=True, slots=True)
class SimBenchConfig:
    bench: SloBenchConfig  # configurations, workloads, rates, SLO, seed: as `bench slo`'s
    cost: CostModel
    settings: MeshSettings = field(default_factory=MeshSettings)
    vocab_size: int = DEFAULT_VOCAB
    planner: Callable[[], Decider] | None = None  # a fresh decider per run
    planner_interval_s: float = 10.0
    planner_window_s: float = 60.0  # the TTFT/TPOT samples a decision sees, as the service's


def parse_workers(text: str) -> tuple[Configuration, ...]:
    """`a=prefill:8,decode:8;both:16x2` → configurations; ConfigError naming the bad part."""
    configs: list[Configuration] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, equals, body = part.rpartition("=")
        name = name.strip() if equals else body.strip()
        specs = [_spec(item, part) for item in body.split(",") if item.strip()]
        if not specs:
            raise ConfigError(f"--workers {part!r}: expected ROLE:COUNT[xCORES],...")
        if any(c.name == name for c in configs):
            raise ConfigError(f"--workers: the name {name!r} is given twice")
        configs.append(configuration(name, [s for spec in specs for s in spec]))
    if not configs:
        raise ConfigError("--workers: no configuration, e.g. prefill:8,decode:8")
    return tuple(configs)


def _spec(item: str, part: str) -> list[WorkerSpec]:
    role, _, count = item.strip().partition(":")
    count, _, cores = count.partition("x")
    try:
        n, c = int(count), int(cores or 1)
    except ValueError:
        raise ConfigError(f"--workers {part!r}: {item!r} is not ROLE:COUNT[xCORES]") from None
    if role not in ROLES or n < 0 or c < 1:
        raise ConfigError(f"--workers {part!r}: {item!r}: a role of {ROLES}, a count >= 0")
    return [WorkerSpec(role, c)] * n


def configuration(name: str, specs: list[WorkerSpec]) -> Configuration:
    """`specs` as a `bench slo` configuration on virtual cores; ConfigError without a
    worker that decodes."""
    if not any(s.role in ("decode", "both") for s in specs):
        raise ConfigError(f"configuration {name}: no worker of role decode or both")
    pools, next_core = [], 0
    for spec in specs:
        pools.append(PinnedPool(spec.role, tuple(range(next_core, next_core + spec.cores))))
        next_core += spec.cores
    return Configuration(name, tuple(pools))


def worker_specs(config: Configuration) -> list[WorkerSpec]:
    return [WorkerSpec(pool.role, len(pool.cpus)) for pool in config.pools]


def splits(total: int, step: int, cores: int = 1) -> tuple[Configuration, ...]:
    """Every (prefill, decode, both) split of `total` workers, counts multiples of `step`
    (the last count takes the rest), each with a worker that decodes."""
    if total < 1 or step < 1:
        raise ConfigError("--search needs >= 1 worker and a step >= 1")
    counts = sorted({*range(0, total + 1, step), total})
    found = []
    for prefill in counts:
        for decode in (c for c in counts if prefill + c <= total):
            both = total - prefill - decode
            if decode + both == 0:
                continue
            specs = (
                [WorkerSpec("prefill", cores)] * prefill
                + [WorkerSpec("decode", cores)] * decode
                + [WorkerSpec("both", cores)] * both
            )
            name = ",".join(
                f"{r}:{n}" for r, n in zip(ROLES, (prefill, decode, both), strict=True) if n
            )
            found.append(configuration(name, specs))
    return tuple(found)
