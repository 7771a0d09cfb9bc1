"""The plan of `splitserve up`: `LauncherConfig` → the child processes, in start order.

`child_specs` is a pure function: no process, socket or file is touched; the run
(services/launcher.py) starts what it returns. The children: the scheduler, the workers
(N prefill + M decode, or N of role "both" with `aggregated`; with `--pool ROLE:CPUS` one
worker per pool, pinned to its cores by `--cpus`; with a mesh config each mesh model's own
pools, worker ids `<model>-<role>-<i>`, each with `--model-name <model>` and its `engine:`
flags after the command line's) and the gateway, each `python -m services.cli <service> ...`.
`up` sets some of their flags itself: the gateway's `--host`, `--port` and `--model-dir`,
each worker's `--role`, `--worker-id`, `--model-dir` and `--cpus`, and every service's
`--nats`, `--namespace` and `--otlp-endpoint`; the scheduler and each worker get the next
of `metrics_ports`. The rest are the `*_args` the CLI forwards (flags that differ from their
defaults: services/launch_cli.py). With `--planner`, the planner (`splitserve planner`, NATS
user `planner`) starts after the workers, in roles mode under `--pool` unless told.

`WorkerTemplate` is how a worker starts (`spec(role, worker_id, cpus, metrics_port)`): the
plan's workers come from it, and so do those a PoolTarget adds while serving
(services/pool_follower.py). Another child (a planner) is one more entry of `child_specs`' list;
services/supervisor.py stops a child of a role outside its STOP_ORDER first.

The subtle rule: `up`'s own flags have no `SPLITSERVE_*` variable (`variable=None`) but
`--namespace` and `--log-level`, whose variables every service reads too.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.mesh_config import MeshConfig, model_dir_of
from services.supervisor import ChildSpec
from services.worker.pinning import cpu_list, parse_cpus
from shared.errors import ConfigError
from shared.flags import flag
from shared.models.registry import DEFAULT_MODEL
from shared.nats_options import NatsAuth
from shared.protocol import ROLES
from shared.subjects import DEFAULT_NAMESPACE

SERVICE = (sys.executable, "-m", "services.cli")  # how every child service starts


@dataclass(frozen=True, slots=True)
class PinnedPool:
    """One worker of `role` pinned to `cpus` (`--pool both:0-1`)."""

    role: str
    cpus: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.role}:{cpu_list(self.cpus)}"


def parse_pools(items: Sequence[str]) -> tuple[PinnedPool, ...]:
    """`("prefill:0", "decode:1")` → pools. A comma splits a core list too (`both:0,2` comes
    as `both:0` and `2`): an item without a role continues the one before. ConfigError for
    what is not ROLE:CPUS, a core in two pools, or pools without a decoding worker."""
    entries: list[list[str]] = []
    for item in items:
        role, colon, cpus = item.partition(":")
        if colon:
            entries.append([role.strip(), cpus])
        elif entries:
            entries[-1][1] += "," + item
        else:
            raise ConfigError(f"pool {item!r}: expected ROLE:CPUS, e.g. prefill:0 or both:0-1")
    pools = []
    for role, cpus in entries:
        if role not in ROLES:
            raise ConfigError(f"pool {role}:{cpus}: the role must be one of {ROLES}")
        if not (cores := parse_cpus(cpus)):
            raise ConfigError(f"pool {role}:{cpus}: no core given")
        pools.append(PinnedPool(role, cores))
    cores = [c for pool in pools for c in pool.cpus]
    if twice := sorted({c for c in cores if cores.count(c) > 1}):
        raise ConfigError(f"pools {', '.join(map(str, pools))}: core {twice[0]} is in two pools")
    if pools and not any(pool.role in ("decode", "both") for pool in pools):
        raise ConfigError(f"pools {', '.join(map(str, pools))}: no decode or both worker")
    return tuple(pools)


@dataclass(frozen=True, slots=True)
class LauncherConfig:
    home: Path  # where models are pulled and the embedded nats-server keeps its files
    host: str = flag("127.0.0.1", variable=None, help="the gateway's bind address")
    port: int = flag(8000, variable=None, help="gateway HTTP port")
    nats_url: str = flag(
        "", name="--nats", variable=None, help="use this NATS URL instead of starting one"
    )
    nats_port: int = flag(0, variable=None, help="embedded server port (0: a free one)")
    nats_args: tuple[str, ...] = ()  # with nats_url: the --nats-* flags (credentials, TLS)
    nats_auth: NatsAuth = field(default_factory=NatsAuth)  # with nats_url: the launcher's own
    namespace: str = flag(DEFAULT_NAMESPACE, help="subject prefix")
    mesh_file: Path | None = flag(
        None,
        name="--config",
        variable=None,
        help="a mesh config: several models, routes, fallbacks (YAML)",
    )
    model: str = flag(DEFAULT_MODEL, variable=None, help="a known model name (pulled)")
    model_dir: Path | None = flag(None, variable=None, help="an HF-layout directory instead")
    prefill: int = flag(1, variable=None, help="prefill workers (or 'both')")
    decode: int = flag(1, variable=None, help="decode workers")
    aggregated: bool = flag(
        False, variable=None, help="--prefill N workers of role both, no decode pool"
    )
    pools: tuple[str, ...] = flag(
        (),
        name="--pool",
        variable=None,
        help="ROLE:CPUS, repeatable (--pool prefill:0 --pool decode:1, --pool both:0-1): one "
        "worker of that role pinned to those cores; replaces --prefill/--decode/--aggregated",
    )
    ready_timeout: float = flag(
        300.0, variable=None, help="seconds for the gateway's /ready to answer"
    )
    grace: float = flag(10.0, variable=None, help="SIGTERM → SIGKILL seconds, per group")
    restart_backoff: float = 1.0  # seconds before a first restart; doubles with each recent one
    max_restarts_per_minute: int = flag(
        5, variable=None, help="restarts of one child before up gives up on it"
    )
    log_level: str = flag("INFO", help="DEBUG, INFO, WARNING or ERROR")
    otlp_endpoint: str = flag(
        "", variable=None, help="OTLP/HTTP URL for every service (none: no trace export)"
    )
    metrics_port: int = flag(
        0, variable=None, help="first scheduler/worker /metrics port (0: free ports)"
    )
    planner: bool = flag(
        False,
        variable=None,
        help="also run the planner (its flags: the planner group; `auto` mode is roles with "
        "--pool, replicas otherwise)",
    )
    planner_args: tuple[str, ...] = ()  # planner flags, passed to it as they are
    follow_pool: bool = flag(
        True,
        variable=None,
        help="start and drain workers to match the PoolTargets on <ns>.pool.target "
        "(splitserve scale, the planner); one-model meshes",
    )
    standby_worker: bool = flag(
        True,
        variable=None,
        help="once the mesh serves, keep a worker process with its imports done, for the next "
        "worker started while serving (added, restarted, a reload's): it starts seconds "
        "sooner (services/standby.py); --no-standby-worker: none",
    )
    max_workers: int = flag(
        0, variable=None, help="most workers while following PoolTargets (0: the cores)"
    )
    swap_ramp: float = 30.0  # the gateway's --swap-ramp: a reload's ramp (mesh_reload.py)
    worker_args: tuple[str, ...] = ()  # engine and worker flags passed to every worker
    gateway_args: tuple[str, ...] = ()  # gateway flags, passed to it as they are
    scheduler_args: tuple[str, ...] = ()  # scheduler flags, passed to it as they are
    mesh: MeshConfig | None = None  # `mesh_file` loaded: several models (replaces the pools)

    def __post_init__(self) -> None:
        if self.pools and (self.aggregated or (self.prefill, self.decode) != (1, 1)):
            raise ConfigError(
                "--pool names every worker and its cores: drop --prefill, --decode and --aggregated"
            )
        self.pinned_pools()  # checks them
        if self.prefill < (1 if self.aggregated else 0) or self.decode < 0:
            raise ConfigError("worker counts must be >= 0 (and >= 1 with --aggregated)")
        if not self.aggregated and self.decode < 1:
            raise ConfigError("a disaggregated mesh needs at least one decode worker")
        if self.planner and self.mesh_file is not None:
            raise ConfigError("--planner plans one model's pools: not with a mesh --config")
        if self.max_workers < 0:
            raise ConfigError("--max-workers must be >= 0 (0: this machine's cores)")

    def pinned_pools(self) -> tuple[PinnedPool, ...]:
        return parse_pools(self.pools)


@dataclass(frozen=True, slots=True)
class WorkerPool:
    role: str
    count: int
    model_dir: Path | None
    prefix: str = ""  # of its worker ids: "<model>-" with a mesh config
    argv: tuple[str, ...] = ()  # its model's own flags, after the shared ones
    cpus: tuple[int, ...] = ()  # each of its workers pinned to these cores; (): unpinned


def worker_pools(config: LauncherConfig) -> list[WorkerPool]:
    """The one model's pools from the flags, or each mesh model's from the config file."""
    if config.mesh is None:
        if config.pools:
            return [
                WorkerPool(p.role, 1, config.model_dir, cpus=p.cpus) for p in config.pinned_pools()
            ]
        if config.aggregated:
            return [WorkerPool("both", config.prefill, config.model_dir)]
        return [
            WorkerPool("prefill", config.prefill, config.model_dir),
            WorkerPool("decode", config.decode, config.model_dir),
        ]
    pools = []
    for model in config.mesh.mesh_models:
        model_dir = model_dir_of(model, config.home)
        argv = ("--model-name", model.name, *model.engine_argv)
        counts = [("both", model.aggregated)] if model.aggregated else []
        counts = counts or [("prefill", model.prefill), ("decode", model.decode)]
        pools += [WorkerPool(role, n, model_dir, f"{model.name}-", argv) for role, n in counts]
    return pools


def service_common(config: LauncherConfig, nats_url: str) -> tuple[str, ...]:
    """The flags every service gets: NATS URL, namespace, credentials/TLS, trace endpoint."""
    common = ("--nats", nats_url, "--namespace", config.namespace, *config.nats_args)
    return common + (("--otlp-endpoint", config.otlp_endpoint) if config.otlp_endpoint else ())


@dataclass(frozen=True, slots=True)
class WorkerTemplate:
    """How `up` starts a worker of one model: the plan's own, and those a PoolTarget adds
    (services/pool_follower.py): same model and flags, its own id, role and cores."""

    model_dir: Path | None
    common: tuple[str, ...]  # service_common's flags
    after: tuple[str, ...] = ()  # forwarded worker flags, then the model's own
    prefix: str = ""  # of its worker ids: "<model>-" with a mesh config
    pools: tuple[PinnedPool, ...] = ()  # the plan's pinned pools; (): workers are not pinned
    service: tuple[str, ...] = SERVICE  # the command before "worker"

    def spec(
        self, role: str, worker_id: str, cpus: tuple[int, ...], metrics_port: int
    ) -> ChildSpec:
        argv = (*self.service, "worker", "--role", role, "--model-dir", str(self.model_dir))
        argv += ("--worker-id", worker_id)
        argv += ("--cpus", cpu_list(cpus)) if cpus else ()
        argv += (*self.common, "--metrics-port", str(metrics_port), *self.after)
        return ChildSpec(f"worker {worker_id}", "worker", argv, metrics_port, role, worker_id, cpus)

    def for_pool(self, pool: WorkerPool) -> WorkerTemplate:
        after = self.after + pool.argv
        return replace(self, model_dir=pool.model_dir, prefix=pool.prefix, after=after)


def worker_template(config: LauncherConfig, nats_url: str) -> WorkerTemplate:
    """The template of the command line's one model (with a mesh config: its first's dir)."""
    common = service_common(config, nats_url)
    return WorkerTemplate(config.model_dir, common, config.worker_args, pools=config.pinned_pools())


def planned_workers(config: LauncherConfig) -> list[tuple[WorkerPool, str]]:
    """Each worker of the plan with its id, `<prefix><role>-<i>` numbered over every pool."""
    numbered: Counter[str] = Counter()  # workers of each model and role, over every pool
    workers = []
    for pool in worker_pools(config):
        for _ in range(pool.count):
            name = pool.prefix + pool.role
            workers.append((pool, f"{name}-{numbered[name]}"))
            numbered[name] += 1
    return workers


def child_specs(
    config: LauncherConfig, nats_url: str, metrics_ports: Iterator[int]
) -> list[ChildSpec]:
    """The command table, in start order: the scheduler, the workers, the planner (with
    --planner), the gateway."""
    common = service_common(config, nats_url)
    scheduler = (*SERVICE, "scheduler", *common)
    port = next(metrics_ports)
    scheduler += ("--metrics-port", str(port), *config.scheduler_args)
    specs = [ChildSpec("scheduler", "scheduler", scheduler, port)]
    template = worker_template(config, nats_url)
    for pool, worker_id in planned_workers(config):
        port = next(metrics_ports)
        specs.append(template.for_pool(pool).spec(pool.role, worker_id, pool.cpus, port))
    if config.planner:  # pinned pools are fixed hardware: roles, unless its flags say
        mode = ("--planner-mode", "roles") if config.pools else ()
        port = next(metrics_ports)
        planner = (*SERVICE, "planner", *common, *mode, "--metrics-port", str(port))
        specs.append(ChildSpec("planner", "planner", (*planner, *config.planner_args), port))
    gateway = (*SERVICE, "gateway", "--host", config.host, "--port", str(config.port))
    gateway += ("--model-dir", str(config.model_dir), *common, *config.gateway_args)
    if config.mesh is not None:
        first = config.mesh.mesh_models[0].name
        gateway += ("--mesh-config", str(config.mesh.source), "--served-model-name", first)
    specs.append(ChildSpec("gateway", "gateway", gateway))
    return specs
