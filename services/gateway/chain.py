"""POST /v1/chat/completions and /v1/completions: one body, a chain of targets, in order.

The handler reads the body once (request_body.py). Without a mesh config, or for a name the
router does not know, the chain is the gateway's own model (400 for a name it does not
serve). Otherwise the router decides (a route's rule may count the prompt's tokens, with
the same tokenization the serving model reuses) and the handler walks the chain: a mesh
model through its `ModelClient` (completions.py), an upstream by forwarding the body as sent
(upstream.py). A target that refuses (`Refused`, or a `GenerationFailed` before any reply
started) passes the request on to the next one when its outcome allows it; the last
refusal becomes the client's HTTP answer here (errors.api_error).
Subtle rule: a streamed answer starts only once its model accepted the request, so a
stream never falls back after its first token (migration within the model applies).

Every generation request, with or without a mesh config, is counted by model, route and
traffic class (`x-splitserve-traffic`, checked here: 400 when it is not a plain name).
"""

from __future__ import annotations

import time

from aiohttp import web
from opentelemetry import trace

from services.gateway.completions import generate, own_model
from services.gateway.errors import ApiError, api_error, invalid
from services.gateway.keys import CLIENT, CONFIG
from services.gateway.openai_schema import Kind
from services.gateway.refusals import GenerationFailed, Refused
from services.gateway.request_body import RequestBody
from services.gateway.routed import (
    ROUTE,
    ROUTING,
    UPSTREAM_PATHS,
    RouteState,
    Routing,
    UpstreamTarget,
)
from services.gateway.router import Fallback
from shared.telemetry.tracing import TRAFFIC_HEADER, traffic_class


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def _serve(request: web.Request, kind: Kind) -> web.StreamResponse:
    raw = request.headers.get(TRAFFIC_HEADER, "")
    traffic = traffic_class(raw)
    if raw and not traffic:
        raise invalid(f"header {TRAFFIC_HEADER} must be a name of letters, digits, '.', '_', '-'")
    started = time.perf_counter()
    model, route, status = request.app[CONFIG].served_model_name, "", 500
    try:
        body = await RequestBody.read(request, kind)
        routing, called = request.app.get(ROUTING), body.model
        if routing is None or called is None or not routing.router.knows(called):
            response = await generate(request, await own_model(request, body), body)
        else:
            decision = routing.router.decide(
                called, lambda: routing.prompt_tokens(body, called), traffic
            )
            state = request[ROUTE] = RouteState(decision)
            route = decision.route
            response = await _walk(request, routing, state, body, traffic)
        status = response.status
        return response
    except (Refused, GenerationFailed) as exc:
        error = api_error(exc)
        status = error.status
        raise error from None
    except ApiError as exc:
        status = exc.status
        raise
    finally:
        routed = request.get(ROUTE)
        model = routed.model if routed is not None else model
        metrics = request.app[CLIENT].metrics
        metrics.http_requests.labels(model, route, traffic, str(status)).inc()
        metrics.http_duration.labels(model, route, traffic).observe(time.perf_counter() - started)


async def _walk(
    request: web.Request, routing: Routing, state: RouteState, body: RequestBody, traffic: str
) -> web.StreamResponse:
    """Try each target of the chain until one answers, or one refuses for good."""
    targets = routing.targets(state.decision)
    for at, target in enumerate(targets):
        has_fallback = at + 1 < len(targets)
        state.model = target.name
        span = trace.get_current_span()
        span.set_attributes(
            {"gen_ai.response.model": target.name, "splitserve.route": state.decision.route}
        )
        try:
            if isinstance(target, UpstreamTarget):
                assert routing.upstreams is not None  # set while the app runs
                path = UPSTREAM_PATHS[body.kind]
                return await routing.upstreams.forward(
                    request, target.upstream, target.name, body.json, path
                )
            return await generate(request, target, body, has_fallback)
        except (Refused, GenerationFailed) as exc:
            if not has_fallback or state.answering or not exc.may_try_again:
                raise
            status = api_error(exc).status  # as the route header and the metric show it
            state.fallbacks.append(Fallback(target.name, status))
            request.app[CLIENT].metrics.fallbacks.labels(target.name, str(status), traffic).inc()
    raise AssertionError("a chain has at least one model")
