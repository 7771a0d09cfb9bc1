"""`splitserve up`: one command for the whole mesh on one machine.

Starts nats-server (unless `--nats URL` names one), then one process per service — the
scheduler, the workers (N prefill + M decode, or N of role "both" with `--aggregated`) and
the gateway — each as `python -m services.cli <service> ...` in its own session, so Ctrl-C
reaches only the launcher and shutdown keeps its order.

Supervision (services/supervisor.py): a child that exits unexpectedly is logged and
restarted after a backoff that doubles with each recent restart; past
`max_restarts_per_minute` the launcher gives up on it (and says so); given up on the gateway
or the scheduler, which every request passes, it stops the mesh and exits with an error,
rather than leave a mesh that serves nobody. A gateway port that is taken stops `up` before
anything starts. A restarted worker registers as a new incarnation, `<worker id>-r<n>`: the
scheduler then expires the old one and reports its requests lost (`WorkerLost`), so the
gateway migrates them at once even when the restart beats the heartbeat timeout.
Shutdown on SIGINT/SIGTERM: gateway, workers, scheduler (each group SIGTERM, `grace`
seconds, then SIGUSR1 for a hung child's thread stacks, then SIGKILL), nats-server last.
Once the gateway's `/ready` answers 200 it prints `splitserve is up: http://HOST:PORT/v1`;
if that takes longer than `ready_timeout` it names the children not running and keeps
going.

Flags: `up` takes every engine flag (forwarded to each worker), every gateway flag and
every scheduler flag, and passes on those that differ from their defaults; a flag both a
worker and the gateway or scheduler read (`--max-model-len`, `--block-size`) goes to both.
`up` sets these itself: the gateway's `--host`, `--port` and `--model-dir` (its own flags of
those names), each worker's `--role`, `--worker-id` and `--model-dir`, and every service's
`--nats`, `--namespace`, `--otlp-endpoint` and `--metrics-port`. Its own nats-server gets
fresh credentials at every start and admits only them; each child connects as its role
(shared/nats_auth.py). With `--nats URL`, the `--nats-*` flags go to every child.

Several models: `up --config FILE.yaml` (services/mesh_config.py, docs/mesh-config.md) starts
each mesh model's own pools instead of `--model`/`--prefill`/`--decode`: worker ids
`<model>-<role>-<i>`, each with `--model-name <model>` and its `engine:` flags after the
command line's; the gateway gets `--mesh-config FILE` and the first mesh model as its own.
A bad file stops `up` before anything starts, with the line that is wrong.

Observability: `--otlp-endpoint URL` goes to every service; the scheduler and each worker
get a `--metrics-port` (from `--metrics-port BASE` upwards, or free ports when 0), listed
at start; the gateway serves /metrics on its own port.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from services.gateway.config import GatewayConfig
from services.mesh_config import MeshConfig, MeshConfigError, load_mesh_config, model_dir_of
from services.scheduler.config import SchedulerConfig
from services.supervisor import ChildSpec, MeshDown, Supervisor
from services.worker.cli import add_engine_arguments, engine_argv
from services.worker.config import WorkerConfig
from shared.config import env
from shared.engine.engine_config import EngineConfig
from shared.flags import add_flags, changed_argv, flag_names
from shared.models.registry import DEFAULT_MODEL
from shared.nats_auth import service_role, start_mesh_nats
from shared.nats_options import NatsAuth
from shared.ports import free_port, set_aside
from shared.subjects import DEFAULT_NAMESPACE, Subjects

log = logging.getLogger(__name__)

# `up`'s own flags of these names set them: not forwarded as the gateway's.
GATEWAY_SET_BY_UP = ("host", "port", "model_dir", "mesh_config")
WORKER_SET_BY_UP = ("worker_id", "role", "model_name")


@dataclass(frozen=True, slots=True)
class LauncherConfig:
    home: Path
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str = ""  # "" → start our own nats-server
    nats_port: int = 0  # 0 → a free port
    nats_args: tuple[str, ...] = ()  # with nats_url: the --nats-* flags (credentials, TLS)
    namespace: str = DEFAULT_NAMESPACE
    model: str = DEFAULT_MODEL
    model_dir: Path | None = None  # set: used as is; unset: `model` is pulled
    prefill: int = 1
    decode: int = 1
    aggregated: bool = False  # `prefill` workers of role "both", no decode pool
    ready_timeout: float = 300.0
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL, per group
    restart_backoff: float = 1.0
    max_restarts_per_minute: int = 5
    log_level: str = "INFO"
    otlp_endpoint: str = ""  # passed to every service; "": no trace export
    metrics_port: int = 0  # first /metrics port of scheduler and workers; 0: free ports
    worker_args: tuple[str, ...] = ()  # engine flags passed to every worker as they are
    gateway_args: tuple[str, ...] = ()  # gateway flags, passed to it as they are
    scheduler_args: tuple[str, ...] = ()  # scheduler flags, passed to it as they are
    mesh: MeshConfig | None = None  # `--config FILE`: several models (replaces the pool flags)

    def __post_init__(self) -> None:
        if self.prefill < (1 if self.aggregated else 0) or self.decode < 0:
            raise ValueError("worker counts must be >= 0 (and >= 1 with --aggregated)")
        if not self.aggregated and self.decode < 1:
            raise ValueError("a disaggregated mesh needs at least one decode worker")


def child_specs(config: LauncherConfig, nats_url: str) -> list[ChildSpec]:
    """The command table, in start order."""
    service = (sys.executable, "-m", "services.cli")
    common = ("--nats", nats_url, "--namespace", config.namespace, *config.nats_args)
    if config.otlp_endpoint:
        common += ("--otlp-endpoint", config.otlp_endpoint)
    ports = iter(range(config.metrics_port, config.metrics_port + 1_000))
    set_aside(config.port)  # the gateway binds it only once started: no metrics port takes it

    def metrics() -> tuple[str, ...]:
        return ("--metrics-port", str(next(ports) if config.metrics_port else free_port()))

    scheduler = (*service, "scheduler", *common, *metrics(), *config.scheduler_args)
    specs = [ChildSpec("scheduler", "scheduler", scheduler)]
    for pool in worker_pools(config):
        for i in range(pool.count):
            worker_id = f"{pool.prefix}{pool.role}-{i}"
            argv = (*service, "worker", "--role", pool.role, "--model-dir", str(pool.model_dir))
            argv += ("--worker-id", worker_id, *common, *metrics())
            argv += (*config.worker_args, *pool.argv)
            specs.append(ChildSpec(f"worker {worker_id}", "worker", argv))
    gateway = (*service, "gateway", "--host", config.host, "--port", str(config.port))
    gateway += ("--model-dir", str(config.model_dir), *common, *config.gateway_args)
    if config.mesh is not None:
        first = config.mesh.mesh_models[0].name
        gateway += ("--mesh-config", str(config.mesh.source), "--served-model-name", first)
    specs.append(ChildSpec("gateway", "gateway", gateway))
    return specs


@dataclass(frozen=True, slots=True)
class WorkerPool:
    role: str
    count: int
    model_dir: Path | None
    prefix: str = ""  # of its worker ids: "<model>-" with a mesh config
    argv: tuple[str, ...] = ()  # its model's own flags, after the shared ones


def worker_pools(config: LauncherConfig) -> list[WorkerPool]:
    """The one model's pools from the flags, or each mesh model's from the config file."""
    if config.mesh is None:
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


def http_ready(host: str, port: int) -> Callable[[], bool]:
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/ready"

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=0.5) as response:
                return response.status == 200
        except OSError:
            return False

    return probe


def run_mesh(
    config: LauncherConfig,
    stop: threading.Event,
    children: Callable[[str], list[ChildSpec]] | None = None,
    probe: Callable[[], bool] | None = None,
    poll_interval: float = 0.1,
) -> None:
    """Run the mesh until `stop` is set; `children(nats_url)` and `probe` default to the real
    services and the gateway's `/ready`."""
    children = children or (lambda url: child_specs(config, url))
    probe = probe or http_ready(config.host, config.port)
    nats = None
    nats_url = config.nats_url
    if not nats_url:
        port, subjects = config.nats_port or None, Subjects(config.namespace)
        nats, credentials = start_mesh_nats(config.home / "nats", port, subjects)
        nats_url = nats.url
        log.info("started nats-server (pid %d) at %s", nats.process.pid, nats_url)
        log.info("NATS credentials per role (no anonymous access): %s", credentials.directory)
    specs = children(nats_url)
    if nats is not None:  # each child connects as its role
        role_argv = credentials.argv
        specs = [replace(s, argv=s.argv + role_argv(service_role(s.role, s.argv))) for s in specs]
    for spec in specs:
        if "--metrics-port" in spec.argv:
            port = spec.argv[spec.argv.index("--metrics-port") + 1]
            log.info("%s: metrics on http://%s:%s/metrics", spec.name, config.host, port)
    supervisor = Supervisor(
        specs, config.restart_backoff, config.max_restarts_per_minute, config.grace
    )
    try:
        supervisor.start_all()
        _supervise(config, supervisor, stop, probe, poll_interval)
    finally:
        supervisor.stop_all()
        if nats is not None:
            log.info("stopping nats-server")
            nats.stop()


def _supervise(
    config: LauncherConfig,
    supervisor: Supervisor,
    stop: threading.Event,
    probe: Callable[[], bool],
    poll_interval: float,
) -> None:
    ready_deadline = time.monotonic() + config.ready_timeout
    waiting_for_ready = True
    next_probe = 0.0
    while not stop.wait(poll_interval):
        supervisor.poll()
        if lost := supervisor.lost_essentials():
            raise MeshDown(
                f"gave up on {', '.join(lost)} (see its log above): the mesh cannot serve "
                "without it, so it is stopped"
            )
        now = time.monotonic()
        if not waiting_for_ready or now < next_probe:
            continue
        next_probe = now + 0.5
        if probe():
            print(f"splitserve is up: http://{config.host}:{config.port}/v1", flush=True)
            waiting_for_ready = False
        elif now > ready_deadline:
            missing = ", ".join(supervisor.missing()) or "none (all running)"
            log.warning(
                "gateway not ready after %.0fs; children not running: %s; still supervising",
                config.ready_timeout,
                missing,
            )
            waiting_for_ready = False


def gateway_port_problem(host: str, port: int) -> str | None:
    """Why the gateway could not listen on host:port (the port taken, the address not this
    machine's), or None."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        return f"{host!r} does not resolve ({exc})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="start nats-server, scheduler, workers, gateway")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    parser.add_argument("--nats", default="", help="use this NATS URL instead of starting one")
    parser.add_argument("--nats-port", type=int, default=0, help="embedded server port")
    add_flags(parser.add_argument_group("NATS credentials and TLS (with --nats URL)"), NatsAuth)
    parser.add_argument("--namespace", default=env("namespace", DEFAULT_NAMESPACE))
    parser.add_argument(
        "--config", type=Path, help="a mesh config: several models, routes, fallbacks (YAML)"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a known model name (pulled)")
    parser.add_argument("--model-dir", type=Path, help="an HF-layout directory instead")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (or 'both')")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument(
        "--aggregated", action="store_true", help="--prefill N workers of role both"
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--grace", type=float, default=10.0, help="SIGTERM → SIGKILL seconds")
    parser.add_argument("--max-restarts-per-minute", type=int, default=5)
    parser.add_argument("--log-level", default=env("log_level", "INFO"))
    parser.add_argument("--otlp-endpoint", default="", help="OTLP/HTTP URL for every service")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="first scheduler/worker /metrics port"
    )
    add_engine_arguments(parser.add_argument_group("engine (every worker)"), ("model_dir",))
    add_flags(parser.add_argument_group("worker (every worker)"), WorkerConfig, WORKER_SET_BY_UP)
    engine = flag_names(EngineConfig)
    gateway = parser.add_argument_group("gateway")
    add_flags(gateway, GatewayConfig, (*GATEWAY_SET_BY_UP, *engine))
    add_flags(parser.add_argument_group("scheduler"), SchedulerConfig, engine)
    parser.set_defaults(func=main)


def config_from_args(args: argparse.Namespace, home: Path) -> LauncherConfig:
    return LauncherConfig(
        home=home,
        host=args.host,
        port=args.port,
        nats_url=args.nats,
        nats_port=args.nats_port,
        nats_args=changed_argv(NatsAuth, args) if args.nats else (),
        namespace=args.namespace,
        model=args.model,
        model_dir=args.model_dir,
        prefill=args.prefill,
        decode=0 if args.aggregated else args.decode,
        aggregated=args.aggregated,
        ready_timeout=args.ready_timeout,
        grace=args.grace,
        max_restarts_per_minute=args.max_restarts_per_minute,
        log_level=args.log_level,
        otlp_endpoint=args.otlp_endpoint,
        metrics_port=args.metrics_port,
        worker_args=engine_argv(args) + changed_argv(WorkerConfig, args, WORKER_SET_BY_UP),
        gateway_args=changed_argv(GatewayConfig, args, GATEWAY_SET_BY_UP),
        scheduler_args=changed_argv(SchedulerConfig, args),
    )


def with_mesh_config(config: LauncherConfig, args: argparse.Namespace) -> LauncherConfig:
    """`config` serving the mesh config `args.config`, its known models pulled; exits with
    the file's error (and its line) when it is bad."""
    from shared.models.pull import pull_model

    pool_flags = (args.model_dir, args.model != DEFAULT_MODEL, args.aggregated, args.prefill != 1,
                  args.decode != 1)  # fmt: skip
    if any(pool_flags):
        sys.exit("up: --config names the models and their pools; drop --model, --model-dir, "
                 "--prefill, --decode and --aggregated")  # fmt: skip
    try:
        mesh = load_mesh_config(args.config.resolve())
    except MeshConfigError as exc:
        sys.exit(f"up: {exc}")
    for model in mesh.mesh_models:
        if model.model_dir is None:
            pull_model(model.model, config.home)
    return replace(config, mesh=mesh, model_dir=model_dir_of(mesh.mesh_models[0], config.home))


def main(args: argparse.Namespace) -> None:
    from shared.engine.model_config import ModelConfig, UnsupportedArchitecture
    from shared.models.pull import default_home, pull_model

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s up: %(message)s"
    )
    config = config_from_args(args, default_home())
    if problem := gateway_port_problem(config.host, config.port):
        sys.exit(
            f"splitserve up: the gateway cannot listen on {config.host}:{config.port} "
            f"({problem}); choose another --port"
        )
    if args.config is not None:
        config = with_mesh_config(config, args)
    if config.model_dir is None:
        config = replace(config, model_dir=pull_model(config.model))
    try:  # an architecture the engine does not serve: refused before anything starts
        ModelConfig.from_dir(config.model_dir)
    except (UnsupportedArchitecture, FileNotFoundError) as e:
        sys.exit(f"splitserve up: {e}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run_mesh(config, stop)
    except MeshDown as exc:
        sys.exit(f"splitserve up: {exc}")
