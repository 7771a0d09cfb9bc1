"""LoRA adapters at the gateway: `model` naming an adapter, `/v1/models` listing them with
their `parent`, and vLLM's `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`.

The adapters a mesh serves are those its workers' heartbeats announce (the scheduler's
status); `AdapterDirectory` keeps the names and parents it last heard, asks again when a
request names one it does not know (or its view is older than `FRESH_S`), and learns a load
or unload it forwarded at once. Load and unload go to the scheduler, which sends them to every
worker of the base model (services/scheduler/adapters.py).
The one rule: a name is an adapter only while some worker serves it, so a request for one
just unloaded is refused here (400, as any unknown model) rather than by every worker in turn.
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from services.gateway.errors import ApiError, invalid
from services.gateway.keys import CLIENT
from services.gateway.model_client import ModelClient
from shared.engine.lora.modules import adapter_name_error
from shared.lora_messages import AdapterAction, AdapterCommand, AdapterReport
from shared.protocol import MeshStatus, StatusQuery

FRESH_S = 2.0  # a view of the workers' adapters older than this is asked for again
STATUS_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 90.0  # the scheduler's own wait on workers is 60 s (ADAPTER_TIMEOUT_S)


class AdapterDirectory:
    def __init__(self) -> None:
        self.parents: dict[str, str] = {}  # adapter -> the model of the workers serving it
        self._heard = -FRESH_S  # time.monotonic() of the last status

    async def parent_of(self, client: ModelClient, name: str) -> str | None:
        """The model serving adapter `name`, or None: asked again unless just heard."""
        if name not in self.parents or time.monotonic() - self._heard > FRESH_S:
            await self.refresh(client)
        return self.parents.get(name)

    async def refresh(self, client: ModelClient) -> None:
        try:
            status = await client.bus.request(
                client.subjects.status, StatusQuery(), MeshStatus, timeout=STATUS_TIMEOUT_S
            )
        except Exception:  # no scheduler: the names known so far stand
            return
        self.parents = {
            adapter: worker.heartbeat.model
            for worker in status.workers
            for adapter in worker.heartbeat.adapters
        }
        self._heard = time.monotonic()

    async def cards(self, client: ModelClient) -> list[dict[str, object]]:
        """`/v1/models` entries: one per adapter, its base model as `parent`."""
        await self.refresh(client)
        return [
            {"id": name, "object": "model", "created": 0, "owned_by": "splitserve",
             "parent": parent or client.name, "root": name}
            for name, parent in sorted(self.parents.items())
        ]  # fmt: skip


ADAPTERS = web.AppKey("adapters", AdapterDirectory)


def setup_adapters(app: web.Application) -> None:
    app[ADAPTERS] = AdapterDirectory()
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


async def adapter_client(request: web.Request, name: str) -> ModelClient | None:
    """The client serving requests of adapter `name` (its answers name the adapter), or
    None when no worker of this gateway's model serves one by that name."""
    client = request.app[CLIENT]
    parent = await request.app[ADAPTERS].parent_of(client, name)
    if parent is None or (client.model and parent != client.model):
        return None
    return client.for_adapter(name)


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise invalid("lora_path must be the adapter's directory", "lora_path")
    name = _name(body)
    await _command(request, AdapterCommand(AdapterAction.LOAD, name, path))
    request.app[ADAPTERS].parents[name] = request.app[CLIENT].model
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    name = _name(await _body(request))
    await _command(request, AdapterCommand(AdapterAction.UNLOAD, name))
    request.app[ADAPTERS].parents.pop(name, None)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _command(request: web.Request, command: AdapterCommand) -> None:
    """Every worker of the model loaded (unloaded) it, or ApiError saying which did not."""
    client = request.app[CLIENT]
    command.model = client.model
    try:
        report = await client.bus.request(
            client.subjects.adapters, command, AdapterReport, timeout=COMMAND_TIMEOUT_S
        )
    except Exception as exc:
        raise ApiError(503, f"the scheduler is unavailable ({exc!r})", retry_after=1) from None
    if not report.ok:
        raise ApiError(400, f"LoRA adapter {command.name!r}: {report.reasons()}", "lora_name")


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise invalid("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def _name(body: dict) -> str:
    name = body.get("lora_name")
    reason = "lora_name must be a string" if not isinstance(name, str) else None
    if reason is None and (reason := adapter_name_error(name)) is None:
        return name
    raise invalid(reason, "lora_name")
