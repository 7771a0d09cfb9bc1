"""vLLM's sleep-mode routes on the gateway, for the workers of a model or one worker:
`POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping`, each taking `model=NAME` or
`worker=ID` (neither: every worker), and `/sleep` a `drain_timeout` in seconds (default 30).

Behind the API key like /v1/*. The gateway finds the workers in the scheduler's status and
sends each a `SleepCommand` (shared/sleep_messages.py) on its own subject, all at once; the
answer lists each worker's level and error, 200 when every one carried it out, 409 when
one could not (an engine without sleep mode, a block still in use). The subtle rule: a
worker answers once its level is reached, after draining, so the wait for each reply is
the drain timeout and then some.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.keys import CLIENT
from shared.protocol import MeshStatus, StatusQuery, WorkerStatus
from shared.sleep_level import SleepLevel
from shared.sleep_messages import SleepCommand, SleepReply

STATUS_TIMEOUT_S = 2.0
REPLY_MARGIN_S = 30.0  # beyond the drain: the engine giving back or loading its memory
DEFAULT_DRAIN_S = 30.0


def setup_sleep_routes(app: web.Application) -> None:
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)


async def sleep(request: web.Request) -> web.Response:
    raw = request.query.get("level", "1")
    if raw not in ("1", "2"):
        raise ApiError(400, f"level must be 1 or 2, not {raw!r}", param="level")
    drain = _number(request, "drain_timeout", DEFAULT_DRAIN_S)
    return await _command(request, SleepCommand(SleepLevel(int(raw)), drain))


async def wake_up(request: web.Request) -> web.Response:
    return await _command(request, SleepCommand(SleepLevel.AWAKE))


async def is_sleeping(request: web.Request) -> web.Response:
    workers = await _targets(request)
    levels = {w.heartbeat.worker_id: int(w.heartbeat.sleep_level) for w in workers}
    return web.json_response({"is_sleeping": any(levels.values()), "workers": levels})


async def _command(request: web.Request, command: SleepCommand) -> web.Response:
    client = request.app[CLIENT]
    workers = await _targets(request)
    timeout = command.drain_timeout * 2 + REPLY_MARGIN_S

    async def ask(worker: WorkerStatus) -> dict[str, Any]:
        worker_id = worker.heartbeat.worker_id
        subject = client.subjects.sleep(worker_id)
        try:
            reply = await client.bus.request(subject, command, SleepReply, timeout=timeout)
        except Exception as exc:  # gone, or no answer in time
            return {"id": worker_id, "level": int(worker.heartbeat.sleep_level), "error": repr(exc)}
        return {"id": worker_id, "level": int(reply.level), "error": reply.error}

    answers = await asyncio.gather(*(ask(w) for w in workers))
    failed = any(answer["error"] for answer in answers)
    return web.json_response({"workers": answers}, status=409 if failed else 200)


async def _targets(request: web.Request) -> list[WorkerStatus]:
    model, worker = request.query.get("model", ""), request.query.get("worker", "")
    if model and worker:
        raise ApiError(400, "name a model or a worker, not both", param="worker")
    client = request.app[CLIENT]
    try:
        status = await client.bus.request(
            client.subjects.status, StatusQuery(), MeshStatus, timeout=STATUS_TIMEOUT_S
        )
    except Exception as exc:
        raise ApiError(503, f"no scheduler answered: {exc!r}", retry_after=1) from exc
    found = [
        w
        for w in status.workers
        if model in ("", w.heartbeat.model) and worker in ("", w.heartbeat.worker_id)
    ]
    if not found:
        what = f"model {model!r}" if model else f"worker {worker!r}" if worker else "the mesh"
        raise ApiError(404, f"no worker of {what}", param="worker" if worker else "model")
    return found


def _number(request: web.Request, name: str, default: float) -> float:
    try:
        value = float(request.query.get(name, default))
    except ValueError as exc:
        raise ApiError(400, f"{name} must be a number of seconds", param=name) from exc
    if not 0 <= value <= 3600:
        raise ApiError(400, f"{name} must be within [0, 3600] seconds", param=name)
    return value
