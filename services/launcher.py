"""`splitserve up`'s run: nats-server, the children of the plan under supervision, the
ready probe. The plan is services/launch_plan.py, the command line services/launch_cli.py.

`run_mesh` starts nats-server (unless `--nats URL` names one) in a directory of this mesh's
own (shared/nats_auth.py: mesh_nats_dir, removed at shutdown) with fresh credentials that
it alone admits, each child connecting as its role (shared/nats_auth.py; every worker as
`both`, so it may change role), then the children of the plan, each in its own session, so
Ctrl-C reaches only the launcher and shutdown keeps its order. The scheduler's and
workers' /metrics ports are listed at start (from `--metrics-port BASE` upwards, or free
ones when 0); the gateway serves /metrics on its own port. With one model (no mesh config)
it follows PoolTargets (services/pool_follower.py; connected as the `launcher` NATS user,
or with `--nats URL` as the user's own flags say): workers added and drained while serving.

Supervision (services/supervisor.py): a child that exits unexpectedly is logged and
restarted after a backoff that doubles with each recent restart; past
`max_restarts_per_minute` the launcher gives up on it (and says so); given up on the gateway
or the scheduler, which every request passes, it stops the mesh and exits with an error,
rather than leave a mesh that serves nobody. A child that exits saying it cannot run its
configuration (services/cannot_run.py: a flag its engine refuses) stops the mesh at once
with its message, never restarted. A restarted worker registers as a new
incarnation, `<worker id>-r<n>`: the scheduler then expires the old one and reports its
requests lost (`WorkerLost`), so the gateway migrates them at once even when the restart
beats the heartbeat timeout. Shutdown on SIGINT/SIGTERM: the pool follower's NATS
connection first, then gateway, workers, scheduler (each group SIGTERM, `grace` seconds,
then SIGUSR1 for a hung child's thread stacks, then SIGKILL), nats-server last. Once the
gateway's `/ready` answers 200 it prints `splitserve is up: http://HOST:PORT/v1`; if that
takes longer than `ready_timeout` it names the children not running and keeps going. Either
way, from then on it keeps a standby worker (`--standby-worker`, on by default:
services/standby.py) for the next worker it starts.

With a mesh config, `reload` (set on SIGHUP) reads the file again while serving: new models'
workers start, routes ramp to them, removed models' workers drain and exit
(services/mesh_reload.py); a bad file is refused and the mesh serves as before.

The subtle rule: a free metrics port is never the gateway's, which is free until the
gateway binds it after the others started (`set_aside`).
"""

from __future__ import annotations

import itertools
import logging
import shutil
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from services.launch_plan import LauncherConfig, child_specs, worker_template
from services.mesh_reload import MeshReload
from services.pool_follower import PoolFollower, usable_cores
from services.pool_link import PoolLink
from services.supervisor import ChildSpec, MeshDown, Supervisor
from shared.nats_auth import mesh_nats_dir, service_role, start_mesh_nats
from shared.ports import free_port, set_aside
from shared.subjects import Subjects

log = logging.getLogger(__name__)


def metrics_ports(config: LauncherConfig) -> Iterator[int]:
    """The /metrics ports of the scheduler and the workers, in start order: from
    `metrics_port` upwards, or free ones (never the gateway's port) when it is 0."""
    if config.metrics_port:
        return itertools.count(config.metrics_port)
    set_aside(config.port)  # the gateway binds it only once started: no metrics port takes it
    return (free_port() for _ in itertools.count())


def http_ready(host: str, port: int, model: str = "") -> Callable[[], bool]:
    """The gateway's /ready answers 200 (for `model`'s workers alone, when given)."""
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/ready"
    url += f"?model={urllib.parse.quote(model)}" if model else ""

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
    reload: threading.Event | None = None,
) -> None:
    """Run the mesh until `stop` is set; `children(nats_url)` and `probe` default to the
    plan's children and the gateway's `/ready`; `reload` set: read the mesh config again."""
    ports = metrics_ports(config)
    children = children or (lambda url: child_specs(config, url, ports))
    probe = probe or http_ready(config.host, config.port)
    nats, credentials = None, None
    nats_url, auth = config.nats_url, config.nats_auth
    subjects = Subjects(config.namespace)
    if not nats_url:
        port = config.nats_port or None
        nats_dir = mesh_nats_dir(config.home, config.port)
        nats, credentials = start_mesh_nats(nats_dir, port, subjects)
        nats_url, auth = nats.url, credentials.auth("launcher")
        log.info("started nats-server (pid %d) at %s", nats.process.pid, nats_url)
        log.info("NATS credentials per role (no anonymous access): %s", credentials.directory)

    def credentialed(spec: ChildSpec) -> ChildSpec:  # with up's own server: as its role
        if credentials is None:
            return spec
        return replace(spec, argv=spec.argv + credentials.argv(service_role(spec.role)))

    specs = [credentialed(spec) for spec in children(nats_url)]
    for spec in specs:
        if spec.metrics_port is not None:
            url = f"http://{config.host}:{spec.metrics_port}/metrics"
            log.info("%s: metrics on %s", spec.name, url)
    supervisor = Supervisor(
        specs,
        config.restart_backoff,
        config.max_restarts_per_minute,
        config.grace,
        standby=config.standby_worker,
    )
    follower = None
    if config.follow_pool and config.mesh is None:
        link = PoolLink(nats_url, auth, subjects)
        template = worker_template(config, nats_url)
        most = config.max_workers or len(usable_cores())
        follower = PoolFollower(link, template, supervisor, ports, most, credentialed)
    reloader = None
    if config.mesh is not None:

        def model_ready(model: str) -> bool:
            return http_ready(config.host, config.port, model)()

        reloader = MeshReload(config, supervisor, nats_url, ports, credentialed, model_ready)
    watch = Watch(follower, reloader, reload or threading.Event())
    try:
        supervisor.start_all()
        if follower is not None:
            follower.link.start()
        _supervise(config, supervisor, watch, stop, probe, poll_interval)
    finally:
        if follower is not None:  # first: nothing starts or drains while the mesh stops
            follower.link.close()
        supervisor.stop_all()
        if nats is not None:
            log.info("stopping nats-server")
            nats.stop()
            shutil.rmtree(nats_dir, ignore_errors=True)  # its passwords outlive nothing


@dataclass(frozen=True, slots=True)
class Watch:
    """What changes the running mesh: PoolTargets (one model) or a reload (a mesh config)."""

    follower: PoolFollower | None
    reloader: MeshReload | None
    reload: threading.Event  # set on SIGHUP


def _supervise(
    config: LauncherConfig,
    supervisor: Supervisor,
    watch: Watch,
    stop: threading.Event,
    probe: Callable[[], bool],
    poll_interval: float,
) -> None:
    ready_deadline = time.monotonic() + config.ready_timeout
    waiting_for_ready = True
    next_probe = 0.0
    while not stop.wait(poll_interval):
        supervisor.poll()
        now = time.monotonic()
        if watch.reload.is_set():
            watch.reload.clear()
            if watch.reloader is None:
                log.warning("SIGHUP: no mesh config (--config) to read again; nothing changes")
            else:
                watch.reloader.begin(now)
        if watch.reloader is not None:  # before cannot_run: a reload's own failure is its own
            watch.reloader.step(now)
        if refused := supervisor.cannot_run():
            name, message = refused[0]
            raise MeshDown(f"{name} cannot run this configuration: {message}")
        if lost := supervisor.lost_essentials():
            raise MeshDown(
                f"gave up on {', '.join(lost)} (see its log above): the mesh cannot serve "
                "without it, so it is stopped"
            )
        if watch.follower is not None:
            watch.follower.step(now)
        if not waiting_for_ready or now < next_probe:
            continue
        next_probe = now + 0.5
        if probe():
            print(f"splitserve is up: http://{config.host}:{config.port}/v1", flush=True)
            waiting_for_ready = False
            supervisor.serving()
        elif now > ready_deadline:
            missing = ", ".join(supervisor.missing()) or "none (all running)"
            log.warning(
                "gateway not ready after %.0fs; children not running: %s; still supervising",
                config.ready_timeout,
                missing,
            )
            waiting_for_ready = False
            supervisor.serving()


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
