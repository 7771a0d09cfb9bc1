"""The gateway's aiohttp application: `init_app(config)`, `setup_routes(app)`, `create_runner`.

One NATS connection per process (opened in `cleanup_ctx`, drained on shutdown) and one
token subscription for all requests. Errors leave in the OpenAI shape. With API keys
configured, /v1/*, /tokenize, /detokenize and the sleep routes (sleep_routes.py) need
`Authorization: Bearer <key>`, and so does /admin/reload (reload.py); /health, /ready,
/ping, /version and /metrics stay open.
Every POST to /v1/* runs in a `gateway.request` span (continuing the client's
`traceparent`), marked ERROR when it answers 4xx/5xx or the generation fails.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.adapters import ADAPTERS, setup_adapters
from services.gateway.chain import chat_completions, completions
from services.gateway.config import GatewayConfig
from services.gateway.cors import cors_headers, cors_preflight
from services.gateway.errors import ApiError, api_error
from services.gateway.keys import CLIENT, CONFIG
from services.gateway.limits import setup_limits
from services.gateway.model_client import ModelClient
from services.gateway.pages import setup_pages
from services.gateway.prompting import ModelText
from services.gateway.refusals import GenerationFailed, Refused
from services.gateway.reload import setup_reload
from services.gateway.responses_api import create_response
from services.gateway.routed import ROUTING, setup_routing
from services.gateway.sleep_routes import setup_sleep_routes
from services.gateway.streams import TokenStreams
from services.gateway.tokenize import detokenize, ping, server_version, tokenize
from shared.bus import Bus
from shared.protocol import MeshStatus, StatusQuery
from shared.subjects import Subjects
from shared.telemetry.metrics import GatewayMetrics
from shared.telemetry.tracing import Tracing, extract, fail, setup_tracing

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
STATUS_TIMEOUT_S = 2.0
TRACING = web.AppKey("tracing", Tracing)
METRICS = web.AppKey("metrics", GatewayMetrics)
_KEYED_PATHS = (
    "/v1/", "/tokenize", "/detokenize", "/sleep", "/wake_up", "/is_sleeping", "/admin/"
)  # fmt: skip


def init_app(config: GatewayConfig) -> web.Application:
    middlewares = [cors_preflight, _trace, _errors, _auth]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    setup_limits(app, config)  # after _auth: body size, per-key concurrency and rate
    app.on_response_prepare.append(cors_headers)
    app[CONFIG] = config
    app[TRACING] = tracing = setup_tracing("gateway", config.common.otlp_endpoint)
    app[METRICS] = metrics = GatewayMetrics()
    text = ModelText.load(config.model_dir)

    async def mesh_connection(app: web.Application) -> AsyncIterator[None]:
        name, auth = f"gateway-{config.gateway_id}", config.common.nats_auth
        bus = await Bus.connect(config.common.nats_url, name, auth=auth)
        metrics.registry.register(bus.rejections.counter)
        streams = TokenStreams(bus, Subjects(config.common.namespace), config.gateway_id)
        await streams.start()
        app[CLIENT] = ModelClient(config, bus, streams, text, metrics)
        yield
        await streams.stop()
        await bus.close()
        tracing.shutdown()

    app.cleanup_ctx.append(mesh_connection)
    setup_routes(app)
    setup_routing(app, config)  # several models, routes and fallbacks (routed.py, chain.py)
    setup_reload(app)  # the mesh config read again (reload.py)
    return app


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", prometheus_metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", server_version)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    setup_pages(app)
    setup_adapters(app)
    setup_sleep_routes(app)  # vLLM's /sleep, /wake_up, /is_sleeping


def create_runner(config: GatewayConfig) -> web.AppRunner:
    # A client that disconnects cancels its handler, and token_events then sends Cancel.
    return web.AppRunner(init_app(config), handler_cancellation=True, access_log=None)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 once the scheduler knows an awake prefill-capable and decode-capable worker (of
    the model `?model=NAME` when given)."""
    client = request.app[CLIENT]
    try:
        status = await client.bus.request(
            client.subjects.status, StatusQuery(), MeshStatus, timeout=STATUS_TIMEOUT_S
        )
    except Exception as exc:
        return web.json_response({"ready": False, "reason": f"no scheduler: {exc!r}"}, status=503)
    model = request.query.get("model", "")
    awake = [
        w
        for w in status.workers
        if not (w.heartbeat.draining or w.heartbeat.sleep_level)
        and model in ("", w.heartbeat.model)
    ]
    roles = {w.heartbeat.role for w in awake}
    missing = [
        need
        for need, serving in (("prefill", {"prefill", "both"}), ("decode", {"decode", "both"}))
        if not roles & serving
    ]
    if missing:
        reason = f"no {' and no '.join(missing)} worker"
        return web.json_response({"ready": False, "reason": reason}, status=503)
    return web.json_response({"ready": True, "workers": len(status.workers)})


async def prometheus_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    """Every model (and route) the gateway serves, then each LoRA adapter with its parent."""
    adapters = await request.app[ADAPTERS].cards(request.app[CLIENT])
    if ROUTING in request.app:  # a mesh config: every model and route
        cards = request.app[ROUTING].cards() + adapters
        return web.json_response({"object": "list", "data": cards})
    config = request.app[CONFIG]
    card = {
        "id": config.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "splitserve",
        "max_model_len": config.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card, *adapters]})


@web.middleware
async def _trace(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or not request.path.startswith("/v1/"):
        return await handler(request)
    config = request.app[CONFIG]
    with request.app[TRACING].tracer.start_as_current_span(
        "gateway.request", extract(request.headers), kind=SpanKind.SERVER
    ) as span:
        span.set_attributes(
            {
                "http.request.method": request.method,
                "url.path": request.path,
                "server.port": config.port,
                "gen_ai.request.model": config.served_model_name,
            }
        )
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 400:
            fail(span, f"HTTP {response.status}")
        return response


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except (Refused, GenerationFailed) as exc:
        return api_error(exc).response()
    except web.HTTPException as exc:
        return ApiError(exc.status, exc.reason).response()
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return ApiError(500, "internal server error").response()


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[CONFIG].api_keys
    if keys and request.path.startswith(_KEYED_PATHS):
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").encode()
        # Compare against every key, so the time taken says nothing about which matched.
        matches = [hmac.compare_digest(given, key.encode()) for key in keys]
        if not any(matches):
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
    return await handler(request)
