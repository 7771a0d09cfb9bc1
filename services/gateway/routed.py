"""The router's side of the gateway: `Routing` and `setup_routing(app, config)`.

With `--mesh-config FILE`, a generation request's `model` may name any model of the file or
a route. `Routing` holds per mesh model the gateway's settings, its text (tokenizer, chat
template, context length) and, once the app runs, its `ModelClient` (made once, shared by
every request); for upstreams, one HTTP session (upstream.py). `targets` turns the
Router's decision (router.py) into the chain of targets that the route handler (chain.py)
walks. The answer's `model` names the model that served, and its `x-splitserve-route`
header says how it got there (`route=chat; target=smol-b; served=smol-a; fallbacks=smol-b:503`).
Subtle rule: the header is set as the response starts, and from then on (`answering`) no
other target may answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from services.gateway.config import GatewayConfig, model_max_len
from services.gateway.keys import CLIENT
from services.gateway.model_client import ModelClient
from services.gateway.openai_schema import Kind
from services.gateway.prompting import ModelText
from services.gateway.request_body import RequestBody
from services.gateway.router import Decision, Fallback, Router, route_header
from services.gateway.upstream import UpstreamClient
from services.mesh_config import (
    MeshConfig,
    MeshModel,
    Upstream,
    load_mesh_config,
    model_dir_of,
)
from shared.models.pull import default_home

ROUTE_HEADER = "x-splitserve-route"
UPSTREAM_PATHS: dict[Kind, str] = {"chat": "/chat/completions", "completion": "/completions"}


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    name: str  # the model's name in the mesh config, as the client knows it
    upstream: Upstream


Target = ModelClient | UpstreamTarget


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
    clients: dict[str, ModelClient] = field(default_factory=dict)  # set once the app starts
    upstreams: UpstreamClient | None = None  # set once the app starts

    @classmethod
    def load(cls, config: GatewayConfig, mesh_config: MeshConfig) -> Routing:
        routing = cls(Router(mesh_config), {}, {})
        routing.configs, routing.texts = model_settings(config, mesh_config.mesh_models)
        return routing

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

    def prompt_tokens(self, body: RequestBody, route: str) -> int:
        """The prompt's length in tokens as the first mesh model among the route's rules
        submits it (chat template, tools and options included; the first mesh model of the
        file when the rules name upstreams only). The serving model reuses it when it is
        that model."""
        ruled = [m for m in self.router.rule_models(route) if m in self.texts]
        model = ruled[0] if ruled else next(iter(self.texts))
        return len(body.prompt_ids(model, self.texts[model]))

    def targets(self, decision: Decision) -> list[Target]:
        """The decision's chain: each model's client, or its upstream."""
        chain: list[Target] = []
        for model in decision.chain:
            upstream = self.router.model(model).upstream
            chain.append(
                self.clients[model] if upstream is None else UpstreamTarget(model, upstream)
            )
        return chain


def model_settings(
    config: GatewayConfig, models: tuple[MeshModel, ...]
) -> tuple[dict[str, GatewayConfig], dict[str, ModelText]]:
    """Per mesh model: the gateway's settings and its text (FileNotFoundError: no tokenizer)."""
    configs, texts = {}, {}
    for model in models:
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
    return configs, texts


def model_clients(
    own: ModelClient, configs: dict[str, GatewayConfig], texts: dict[str, ModelText]
) -> dict[str, ModelClient]:
    """A client per mesh model, sharing the gateway's own bus, token streams and metrics."""
    return {
        name: ModelClient(config, own.bus, own.streams, texts[name], own.metrics, name)
        for name, config in configs.items()
    }


ROUTING = web.AppKey("routing", Routing)
ROUTE = web.RequestKey("route", RouteState)


def setup_routing(app: web.Application, config: GatewayConfig) -> None:
    """With a mesh config: the router, a client per mesh model and the upstreams' session."""
    if config.mesh_config is None:
        return
    app[ROUTING] = routing = Routing.load(config, load_mesh_config(config.mesh_config))
    app.on_response_prepare.append(_route_header)

    async def connections(app: web.Application) -> AsyncIterator[None]:
        # its bus, token streams and metrics serve every model
        routing.clients = model_clients(app[CLIENT], routing.configs, routing.texts)
        async with aiohttp.ClientSession() as session:
            routing.upstreams = UpstreamClient(session)
            yield

    app.cleanup_ctx.append(connections)


async def _route_header(request: web.Request, response: web.StreamResponse) -> None:
    state = request.get(ROUTE)
    if state is not None:
        state.answering = True
        response.headers[ROUTE_HEADER] = route_header(state.decision, state.model, state.fallbacks)
