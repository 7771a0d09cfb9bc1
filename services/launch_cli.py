"""`splitserve up`'s command line: its flags, made from the dataclasses that declare them,
and `main`, which checks what it can before anything starts and then runs the mesh.

Flags: `up`'s own are `LauncherConfig`'s (services/launch_plan.py); it also takes every
engine flag (forwarded to each worker), every worker, gateway and scheduler flag, and
passes on those that differ from their defaults (`changed_argv`). A flag both a worker and
the gateway or scheduler read (`--max-model-len`, `--block-size`) is one flag, given to
both. With `--nats URL`, the `--nats-*` flags go to every child (and the launcher's own
connection, which follows PoolTargets); without, `up`'s own nats-server hands each child
its role's fresh credentials (services/launcher.py).

The subtle rule: everything that can be refused is refused before anything starts: pool
counts that cannot run (`ConfigError`), a `--pool` beside the count flags or on a core this
machine does not let it use, a gateway port that is taken, a bad mesh config (with the line
that is wrong), pool flags beside a mesh config, an architecture the engine does not serve,
the planner's objectives or bounds (`--planner --slo ...`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

from services.gateway.config import GatewayConfig
from services.launch_plan import LauncherConfig
from services.launcher import gateway_port_problem, run_mesh
from services.mesh_config import MeshConfigError, load_mesh_config, model_dir_of
from services.planner.config import PlannerConfig, PlannerServiceConfig, add_planner_flags
from services.scheduler.config import SchedulerConfig
from services.supervisor import MeshDown
from services.worker.cli import add_engine_arguments, engine_argv
from services.worker.config import WorkerConfig
from services.worker.pinning import check_cpus
from shared.engine.engine_config import EngineConfig
from shared.errors import ConfigError
from shared.flags import add_flags, build, changed_argv, flag_names
from shared.models.registry import DEFAULT_MODEL
from shared.nats_options import NatsAuth

# `up`'s own flags of these names set them: not forwarded as the gateway's.
GATEWAY_SET_BY_UP = ("host", "port", "model_dir", "mesh_config")
WORKER_SET_BY_UP = ("worker_id", "role", "model_name", "cpus")  # cpus: from --pool


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="start nats-server, scheduler, workers, gateway")
    add_flags(parser, LauncherConfig)
    add_flags(parser.add_argument_group("NATS credentials and TLS (with --nats URL)"), NatsAuth)
    add_engine_arguments(parser.add_argument_group("engine (every worker)"), ("model_dir",))
    add_flags(parser.add_argument_group("worker (every worker)"), WorkerConfig, WORKER_SET_BY_UP)
    engine = flag_names(EngineConfig)
    gateway = parser.add_argument_group("gateway")
    add_flags(gateway, GatewayConfig, (*GATEWAY_SET_BY_UP, *engine))
    add_flags(parser.add_argument_group("scheduler"), SchedulerConfig, engine)
    add_planner_flags(parser.add_argument_group("planner (with --planner)"))
    parser.set_defaults(func=main)


def config_from_args(args: argparse.Namespace, home: Path) -> LauncherConfig:
    if args.planner:  # its objectives and bounds: refused here, not by the child
        PlannerServiceConfig.from_args(args)
    return build(
        LauncherConfig,
        args,
        home=home,
        nats_args=changed_argv(NatsAuth, args) if args.nats_url else (),
        nats_auth=build(NatsAuth, args) if args.nats_url else NatsAuth(),
        decode=0 if args.aggregated else args.decode,
        worker_args=engine_argv(args) + changed_argv(WorkerConfig, args, WORKER_SET_BY_UP),
        gateway_args=changed_argv(GatewayConfig, args, GATEWAY_SET_BY_UP),
        swap_ramp=args.swap_ramp,
        scheduler_args=changed_argv(SchedulerConfig, args) + _path_objectives(args),
        planner_args=changed_argv(PlannerServiceConfig, args) + changed_argv(PlannerConfig, args),
    )


def _path_objectives(args: argparse.Namespace) -> tuple[str, ...]:
    """With --planner, the scheduler chooses each request's path by the planner's objectives
    (`--path-choice auto` is slo once it has them), unless `--path-slo` or a path choice is
    given: one mesh, one set of objectives."""
    told = args.path_slo or args.path_choice != "auto"
    return () if not args.planner or told else ("--path-slo", args.slo)


def keep_quant(args: argparse.Namespace) -> bool | None:
    """How `up` pulls a model: False (a float32 copy) where the workers cannot serve one kept
    quantized (--engine vllm, a GPU, --quantization), else None (whichever is there, a new
    pull kept as it ships)."""
    import torch

    gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    return False if args.engine_kind == "vllm" or args.quantization or gpu else None


def with_mesh_config(
    config: LauncherConfig, mesh_file: Path, args: argparse.Namespace
) -> LauncherConfig:
    """`config` serving the mesh config `mesh_file`, its known models pulled; exits with
    the file's error (and its line) when it is bad."""
    from shared.models.pull import pull_model

    pool_flags = (config.model_dir, config.model != DEFAULT_MODEL, config.aggregated,
                  config.prefill != 1, config.decode != 1, config.pools)  # fmt: skip
    if any(pool_flags):
        sys.exit("up: --config names the models and their pools; drop --model, --model-dir, "
                 "--prefill, --decode, --aggregated and --pool")  # fmt: skip
    try:
        mesh = load_mesh_config(mesh_file.resolve())
    except MeshConfigError as exc:
        sys.exit(f"up: {exc}")
    for model in mesh.mesh_models:
        if model.model_dir is None:
            pull_model(model.model, config.home, keep_quant(args))
    return replace(config, mesh=mesh, model_dir=model_dir_of(mesh.mesh_models[0], config.home))


def main(args: argparse.Namespace) -> None:
    from shared.engine.model_config import ModelConfig, UnsupportedArchitecture
    from shared.models.pull import default_home, pull_model

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s up: %(message)s"
    )
    try:
        config = config_from_args(args, default_home())
        for pool in config.pinned_pools():
            check_cpus(pool.cpus)
    except ConfigError as exc:  # pools: refused like the rest, before anything starts
        sys.exit(f"splitserve up: {exc}")
    if problem := gateway_port_problem(config.host, config.port):
        sys.exit(
            f"splitserve up: the gateway cannot listen on {config.host}:{config.port} "
            f"({problem}); choose another --port"
        )
    if config.mesh_file is not None:
        config = with_mesh_config(config, config.mesh_file, args)
    if config.model_dir is None:
        config = replace(config, model_dir=pull_model(config.model, keep_quant=keep_quant(args)))
    try:  # an architecture the engine does not serve: refused before anything starts
        ModelConfig.from_dir(config.model_dir)
    except (UnsupportedArchitecture, FileNotFoundError) as e:
        sys.exit(f"splitserve up: {e}")
    stop, reload = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload.set())  # --config read again
    try:
        run_mesh(config, stop, reload=reload)
    except MeshDown as exc:
        sys.exit(f"splitserve up: {exc}")
