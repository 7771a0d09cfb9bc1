"""CORS for the API routes (/v1/*), so web pages on other origins can call the gateway.

Allowed origins come from `--cors-origins` (default none: browsers refuse every
cross-origin call; `*` allows any). A preflight (`OPTIONS` with an `Origin`) is answered
here, before authentication, with 204 for an allowed origin and 403 without CORS headers
for any other. Every response to an allowed origin, streamed ones included, gets
`Access-Control-Allow-Origin` just before its headers are sent. Credentials (cookies) are
never allowed: the API authenticates with a bearer key, which needs none.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from services.gateway.keys import CONFIG

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
API_PREFIX = "/v1/"
ALLOW_METHODS = "GET, POST, OPTIONS"
# What the OpenAI SDK and fetch send; a preflight may ask for more (x-stainless-*), echoed.
BASE_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE_S = 600


def origin_allowed(request: web.Request) -> bool:
    origin = request.headers.get("Origin")
    allowed = request.app[CONFIG].cors_origins
    return origin is not None and ("*" in allowed or origin in allowed)


@web.middleware
async def cors_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    is_preflight = (
        request.method == "OPTIONS"
        and request.path.startswith(API_PREFIX)
        and "Access-Control-Request-Method" in request.headers
    )
    if not is_preflight:
        return await handler(request)
    if not origin_allowed(request):
        return web.Response(status=403, text="origin not allowed")
    asked = request.headers.get("Access-Control-Request-Headers", "")
    headers = {
        "Access-Control-Allow-Methods": ALLOW_METHODS,
        "Access-Control-Allow-Headers": f"{BASE_HEADERS}, {asked}" if asked else BASE_HEADERS,
        "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
    }
    return web.Response(status=204, headers=headers)


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: mark responses to an allowed origin as readable by it."""
    if not request.path.startswith(API_PREFIX):
        return
    response.headers["Vary"] = "Origin"
    if origin_allowed(request):
        response.headers["Access-Control-Allow-Origin"] = request.headers["Origin"]
        response.headers["Access-Control-Expose-Headers"] = "Retry-After, x-splitserve-route"
