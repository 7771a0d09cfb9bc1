"""The router in the gateway's request path (`setup_routing(app, config)`).

With `--mesh-config FILE`, a generation request's `model` may name any model of the file or
a route. The middleware `route_request` (innermost: after auth) asks the Router
(services/gateway/router.py) for the chain of models to try and tries them in order:
  - a mesh model: the handler runs with that model's `Mesh` (its tokenizer, chat template
    and context length; its requests go to its workers only); `routed_mesh` hands it over;
  - an upstream: the body is forwarded (services/gateway/upstream.py).
A model that refuses before answering (429, 503: no worker registered, a full queue; an
upstream that is unreachable, slow to start, or answers 429/5xx) passes the request on to
the next in the chain. A streamed answer starts only once its model accepted the request,
so a stream never falls back after its first token (migration within the model applies).
The answer's `model` names the model that served, and its `x-splitserve-route` header says
how it got there (`route=chat; target=smol-b; served=smol-a; fallbacks=smol-b:503`).

Every generation request, with or without a mesh config, is counted by model, route and
traffic class (`x-splitserve-traffic`, checked here: 400 when it is not a plain name).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from opentelemetry import trace

from services.gateway.config import GatewayConfig, model_max_len
from services.gateway.errors import ApiError, invalid
from services.gateway.generation import Mesh
from services.gateway.keys import CONFIG, MESH
from services.gateway.openai_schema import Kind, parse_request
from services.gateway.prompting import ModelText
from services.gateway.router import Decision, Fallback, Router, route_header
from services.gateway.upstream import UpstreamClient, UpstreamUnavailable
from services.mesh_config import MeshConfig, load_mesh_config, model_dir_of
from shared.models.pull import default_home
from shared.telemetry.tracing import TRAFFIC_HEADER, traffic_class

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ROUTE_HEADER = "x-splitserve-route"
KINDS: dict[str, tuple[Kind, str]] = {  # path -> (kind, the upstream's path)
    "/v1/chat/completions": ("chat", "/chat/completions"),
    "/v1/completions": ("completion", "/completions"),
}
FALLBACK_STATUSES = (429, 502, 503, 504)


@dataclass(slots=True)
class RouteState:
    """One request's way through the router, for its header and metrics."""

    decision: Decision
    model: str = ""  # the model of the chain trying (or, once it answers, serving) it
    answering: bool = False  # its response has started: no other model may answer now
    fallbacks: list[Fallback] = field(default_factory=list)


@dataclass(slots=True)
class Routing:
    router: Router
    configs: dict[str, GatewayConfig]  # per mesh model: the gateway's settings for it
    texts: dict[str, ModelText]  # per mesh model
    upstreams: UpstreamClient | None = None  # set once the app starts

    @classmethod
    def load(cls, config: GatewayConfig, mesh_config: MeshConfig) -> Routing:
        configs, texts = {}, {}
        for model in mesh_config.mesh_models:
            model_dir = model_dir_of(model, default_home())
            if not (model_dir / "tokenizer.json").is_file():
                raise FileNotFoundError(
                    f"model {model.name!r}: no tokenizer in {model_dir} (pull the model first)"
                )
            configs[model.name] = dataclasses.replace(
                config,
                model_dir=model_dir,
                served_model_name=model.name,
                max_model_len=model_max_len(model_dir),
            )
            texts[model.name] = ModelText.load(model_dir)
        return cls(Router(mesh_config), configs, texts)

    def cards(self) -> list[dict[str, object]]:
        """`/v1/models`: every model and route of the mesh config."""
        cards = []
        for name, kind in self.router.names():
            card: dict[str, object] = {"id": name, "object": "model", "created": 0}
            card |= {"owned_by": "splitserve", "splitserve_kind": kind}
            if name in self.configs:
                card["max_model_len"] = self.configs[name].max_model_len
            cards.append(card)
        return cards

    def prompt_tokens(self, kind: Kind, body: object, route: str) -> int:
        """The prompt's length in tokens, with the tokenizer of the first mesh model among
        the route's rules (of the first mesh model of the file when they are upstreams)."""
        ruled = [m for m in self.router.rule_models(route) if m in self.texts]
        text = self.texts[ruled[0]] if ruled else next(iter(self.texts.values()))
        parsed = parse_request(kind, body)
        if parsed.messages is not None:
            return len(text.chat_prompt_ids(parsed.messages))
        assert parsed.prompt is not None
        return len(text.completion_prompt_ids(parsed.prompt, parsed.suffix))


ROUTING = web.AppKey("routing", Routing)
ROUTED = web.RequestKey("routed_mesh", Mesh)
ROUTE = web.RequestKey("route", RouteState)


def setup_routing(app: web.Application, config: GatewayConfig) -> None:
    """The router middleware and, with a mesh config, the router and its HTTP session."""
    app.middlewares.append(route_request)
    if config.mesh_config is None:
        return
    app[ROUTING] = routing = Routing.load(config, load_mesh_config(config.mesh_config))
    app.on_response_prepare.append(_route_header)

    async def upstream_session(app: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession() as session:
            routing.upstreams = UpstreamClient(session)
            yield

    app.cleanup_ctx.append(upstream_session)


def serving_mesh(request: web.Request) -> Mesh:
    """The Mesh the router chose for this request, else the gateway's one model (unchecked:
    `routed_mesh` checks the model's name)."""
    return request.get(ROUTED) or request.app[MESH]


def routed_mesh(request: web.Request, model: str) -> Mesh:
    """The Mesh to serve this request: the router's choice, else the gateway's one model
    (400 when `model` is not its name)."""
    routed = request.get(ROUTED)
    if routed is not None:
        return routed
    mesh = request.app[MESH]
    if model != mesh.config.served_model_name:
        raise ApiError(
            400, f"model {model!r} does not exist", param="model", code="model_not_found"
        )
    return mesh


@web.middleware
async def route_request(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or request.path not in KINDS:
        return await handler(request)
    raw = request.headers.get(TRAFFIC_HEADER, "")
    traffic = traffic_class(raw)
    if raw and not traffic:
        raise invalid(f"header {TRAFFIC_HEADER} must be a name of letters, digits, '.', '_', '-'")
    started = time.perf_counter()
    model, route, status = request.app[CONFIG].served_model_name, "", 500
    try:
        routing = request.app.get(ROUTING)
        body = await _body(request)
        called = body.get("model") if isinstance(body, dict) else None
        if routing is None or not isinstance(called, str) or not routing.router.knows(called):
            response = await handler(request)
        else:
            state = request[ROUTE] = _decide(request, routing, body, called, traffic)
            route = state.decision.route
            response = await _try_chain(request, handler, routing, state, body, traffic)
        status = response.status
        return response
    except ApiError as exc:
        status = exc.status
        raise
    finally:
        state = request.get(ROUTE)
        model = state.model if state is not None else model
        metrics = request.app[MESH].metrics
        metrics.http_requests.labels(model, route, traffic, str(status)).inc()
        metrics.http_duration.labels(model, route, traffic).observe(time.perf_counter() - started)


def _decide(
    request: web.Request, routing: Routing, body: dict, called: str, traffic: str
) -> RouteState:
    kind = KINDS[request.path][0]
    decision = routing.router.decide(
        called, lambda: routing.prompt_tokens(kind, body, called), traffic
    )
    return RouteState(decision)


async def _try_chain(
    request: web.Request,
    handler: Handler,
    routing: Routing,
    state: RouteState,
    body: dict,
    traffic: str,
) -> web.StreamResponse:
    base = request.app[MESH]
    chain = state.decision.chain
    for at, model in enumerate(chain):
        has_fallback = at + 1 < len(chain)
        state.model = model
        span = trace.get_current_span()
        span.set_attributes(
            {"gen_ai.response.model": model, "splitserve.route": state.decision.route}
        )
        try:
            upstream = routing.router.config.model(model).upstream
            if upstream is not None:
                assert routing.upstreams is not None  # set while the app runs
                path = KINDS[request.path][1]
                response = await routing.upstreams.forward(request, upstream, model, body, path)
            else:
                text, config = routing.texts[model], routing.configs[model]
                request[ROUTED] = Mesh(
                    config, base.bus, base.streams, text, base.metrics, model, has_fallback
                )
                response = await handler(request)
        except (ApiError, UpstreamUnavailable) as exc:
            if not has_fallback or state.answering or exc.status not in FALLBACK_STATUSES:
                if isinstance(exc, UpstreamUnavailable):
                    raise ApiError(exc.status, str(exc), code="upstream_unavailable") from None
                raise
            state.fallbacks.append(Fallback(model, exc.status))
            base.metrics.fallbacks.labels(model, str(exc.status), traffic).inc()
            continue
        return response
    raise AssertionError("a chain has at least one model")


async def _body(request: web.Request) -> object:
    """The JSON body, or None when it is not JSON (the handler answers 400 for it)."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


async def _route_header(request: web.Request, response: web.StreamResponse) -> None:
    state = request.get(ROUTE)
    if state is not None:
        state.answering = True
        response.headers[ROUTE_HEADER] = route_header(state.decision, state.model, state.fallbacks)
