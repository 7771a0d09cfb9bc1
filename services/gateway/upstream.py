"""Forwarding a request to an external OpenAI-compatible server (a mesh config's `upstream`).

The body goes on as the client sent it, with `model` set to the upstream's name for the
model; the answer comes back with `model` set to the name the client knows it by (JSON, or
each SSE `data:` chunk). One aiohttp session per gateway. Until the upstream's response
starts, every failure is `UpstreamUnavailable` (refusals.py; the chain falls back): no
connection within `connect_timeout`, no response headers within `response_timeout`, an
answer of 429 or 5xx, or one that is not JSON. A 4xx answer is the client's and is passed
on as is. Once a stream has started, a failure ends it with an error event (no fallback
after the first token).
"""

from __future__ import annotations

import json
import logging
import os

import aiohttp
from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.refusals import UpstreamUnavailable
from services.mesh_config import Upstream

log = logging.getLogger(__name__)
MAX_ERROR_TEXT = 300  # characters of an upstream's error body kept in our message


class UpstreamClient:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def forward(
        self, request: web.Request, upstream: Upstream, served_name: str, body: dict, path: str
    ) -> web.StreamResponse:
        """POST `body` to the upstream's `path` ("/chat/completions" or "/completions")."""
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(upstream.api_key_env, "") if upstream.api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=upstream.connect_timeout,
            sock_connect=upstream.connect_timeout,
            sock_read=upstream.response_timeout,
        )
        url = upstream.url + path
        try:
            response = await self.session.post(
                url, json=body | {"model": upstream.model}, headers=headers, timeout=timeout
            )
        except TimeoutError:
            raise UpstreamUnavailable(f"upstream {url} timed out", 504) from None
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"upstream {url} unreachable: {exc}", 502) from None
        async with response:
            if response.status == 429 or response.status >= 500:
                text = (await _text(response))[:MAX_ERROR_TEXT]
                raise UpstreamUnavailable(
                    f"upstream {url} answered {response.status}: {text}", response.status
                )
            if response.content_type == "text/event-stream":
                return await _relay_stream(request, response, served_name)
            return await _relay_body(response, served_name)


async def _text(response: aiohttp.ClientResponse) -> str:
    try:
        return await response.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return ""


async def _relay_body(response: aiohttp.ClientResponse, served_name: str) -> web.Response:
    try:
        raw = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UpstreamUnavailable(f"upstream answer cut off: {exc!r}", 502) from None
    try:
        data = json.loads(raw)
    except ValueError:
        message = "the upstream's answer is not JSON"
        raise UpstreamUnavailable(message, 502, code="bad_upstream") from None
    if isinstance(data, dict) and "model" in data:
        data["model"] = served_name
    return web.json_response(data, status=response.status)


async def _relay_stream(
    request: web.Request, response: aiohttp.ClientResponse, served_name: str
) -> web.StreamResponse:
    out = web.StreamResponse(
        status=response.status,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    )
    await out.prepare(request)
    try:
        async for line in response.content:
            await out.write(_renamed(line, served_name))
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("upstream stream cut off: %r", exc)
        error = ApiError(502, f"the upstream stream was cut off: {exc!r}", code="bad_upstream")
        await out.write(f"data: {json.dumps(error.body())}\n\n".encode())
    await out.write_eof()
    return out


def _renamed(line: bytes, served_name: str) -> bytes:
    """An SSE line with the chunk's `model` renamed (other lines unchanged)."""
    if not line.startswith(b"data: {"):
        return line
    try:
        chunk = json.loads(line[len(b"data: ") :])
    except ValueError:
        return line
    if isinstance(chunk, dict) and "model" in chunk:
        chunk["model"] = served_name
    return b"data: " + json.dumps(chunk).encode() + b"\n"
