"""Reloading the gateway's mesh config: `POST /admin/reload` (behind the API key) and SIGHUP.

`reload_routing(app)` reads the `--mesh-config` file again. A bad file is refused with its
error (400 on the route, logged on SIGHUP) and nothing changes. A good one replaces the
router in place: a new model gets its text and client, a route whose targets or rules
changed ramps from the old ones to the new over `--swap-ramp` seconds (router.py's Ramp),
and a removed model that an old route names stays reachable through it (retiring) until
the ramp ends. Requests in flight keep the client they hold.

Under `splitserve up` (services/supervisor.py's UP_PID_ENV in the environment) the route
checks the file and asks the launcher to reload (SIGHUP to it): the launcher starts the new
models' workers, waits until they serve, then sends this gateway SIGHUP, so no traffic
moves to a model without workers. The subtle rule: under `up`, the launcher alone decides
when the gateway reloads; the route only asks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.keys import CLIENT, CONFIG
from services.gateway.routed import ROUTING, Routing, model_clients, model_settings
from services.gateway.router import Ramp, Router
from services.mesh_config import MeshConfig, MeshConfigError, load_mesh_config
from services.mesh_routes import Route
from services.supervisor import UP_PID_ENV

log = logging.getLogger(__name__)
RELOADING = web.AppKey("reloading", asyncio.Lock)


def setup_reload(app: web.Application) -> None:
    """With a mesh config: POST /admin/reload (SIGHUP: `hangup_handler`, set by the CLI)."""
    if ROUTING not in app:
        return
    app[RELOADING] = asyncio.Lock()
    app.router.add_post("/admin/reload", admin_reload)


async def admin_reload(request: web.Request) -> web.Response:
    app = request.app
    path = app[CONFIG].mesh_config
    assert path is not None  # the route exists with a mesh config only
    launcher = os.environ.get(UP_PID_ENV, "")
    if launcher:
        try:
            load_mesh_config(path)  # refused here, before the launcher hears of it
        except MeshConfigError as exc:
            raise ApiError(400, f"reload refused, the mesh is unchanged: {exc}") from None
        os.kill(int(launcher), signal.SIGHUP)
        return web.json_response({"reload": "asked of splitserve up", "config": str(path)}, 202)
    try:
        summary = await reload_routing(app)
    except (MeshConfigError, FileNotFoundError) as exc:
        raise ApiError(400, f"reload refused, the mesh is unchanged: {exc}") from None
    return web.json_response({"reload": "done", **summary})


def hangup_handler(app: web.Application) -> Callable[[], None]:
    """SIGHUP's handler: reload, logging a refusal (the tasks are kept until they end)."""
    running: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        try:
            summary = await reload_routing(app)
        except (MeshConfigError, FileNotFoundError) as exc:
            log.error("reload refused, the mesh is unchanged: %s", exc)
            return
        log.info("reloaded %s: %s", app[CONFIG].mesh_config, summary)

    def handle() -> None:
        task = asyncio.ensure_future(reload())
        running.add(task)
        task.add_done_callback(running.discard)

    return handle


async def reload_routing(app: web.Application) -> dict[str, list[str]]:
    """Read the mesh config again and route by it (MeshConfigError or FileNotFoundError:
    nothing changed); what changed, for the answer and the log."""
    config = app[CONFIG]
    assert config.mesh_config is not None
    async with app[RELOADING]:
        mesh = load_mesh_config(config.mesh_config)
        routing = app[ROUTING]
        kept = set(routing.configs)
        added = tuple(m for m in mesh.mesh_models if m.name not in kept)
        configs, texts = model_settings(config, added)  # FileNotFoundError: nothing changed
        swap(routing, mesh, config.swap_ramp, time.monotonic())
        live = {m.name for m in (*mesh.mesh_models, *routing.router.retiring)}
        routing.configs = {n: c for n, c in routing.configs.items() if n in live} | configs
        routing.texts = {n: t for n, t in routing.texts.items() if n in live} | texts
        clients = {n: c for n, c in routing.clients.items() if n in live}
        routing.clients = clients | model_clients(app[CLIENT], configs, texts)
        names = {m.name for m in mesh.models}
        return {
            "added": [m.name for m in added],
            "removed": sorted(kept - names),
            "ramping": routing.router.ramping(),
        }


def swap(routing: Routing, mesh: MeshConfig, ramp_s: float, now: float) -> None:
    """Route by `mesh` from now on: each route that changed ramps from its old self."""
    old = routing.router
    previous = {route.name: route for route in old.config.routes}
    ramps = {
        route.name: Ramp(previous[route.name], now, ramp_s)
        for route in mesh.routes
        if route.name in previous and _changed(previous[route.name], route)
    }
    names = {m.name for m in mesh.models}
    named = {e.model for ramp in ramps.values() for e in (*ramp.old.targets, *ramp.old.rules)}
    retiring = tuple(old.model(n) for n in sorted(named - names))
    routing.router = Router(mesh, old.rng, ramps, retiring, old.clock)


def _changed(old: Route, new: Route) -> bool:
    """The route chooses otherwise (its line in the file aside)."""

    def choices(route: Route) -> tuple[tuple[object, ...], ...]:
        targets = tuple((t.model, t.weight, t.traffic) for t in route.targets)
        return targets, tuple((r.model, r.max_prompt_tokens) for r in route.rules)

    return choices(old) != choices(new)
