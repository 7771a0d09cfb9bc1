"""Forwarding to an OpenAI-compatible upstream (in-process aiohttp servers on loopback): the
upstream's model name goes out, the served name comes back (JSON and SSE), a client error
passes through, and refusals (429, 5xx, nothing listening) become UpstreamUnavailable."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from services.gateway.upstream import UpstreamClient, UpstreamUnavailable
from services.mesh_config import Upstream
from shared.ports import free_port

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def through(
    answer: Answer, body: dict, upstream_port: int | None
) -> tuple[int, str, list[dict]]:
    """POST `body` to a gateway whose only route forwards to an upstream that `answer`s
    (or to `upstream_port`, where nothing listens); the status, the raw answer, and what the
    upstream received."""
    received: list[dict] = []

    async def upstream_handler(request: web.Request) -> web.StreamResponse:
        received.append(await request.json())
        return await answer(request)

    upstream_app = web.Application()
    upstream_app.router.add_post("/v1/chat/completions", upstream_handler)
    upstream_runner = web.AppRunner(upstream_app)
    await upstream_runner.setup()
    await web.TCPSite(upstream_runner, "127.0.0.1", 0).start()
    port = upstream_port or upstream_runner.addresses[0][1]
    upstream = Upstream(f"http://127.0.0.1:{port}/v1", "their-name", connect_timeout=1)
    async with aiohttp.ClientSession() as session:
        client = UpstreamClient(session)

        async def gateway_handler(request: web.Request) -> web.StreamResponse:
            try:
                return await client.forward(request, upstream, "ours", body, "/chat/completions")
            except UpstreamUnavailable as exc:
                return web.json_response({"unavailable": exc.status, "why": str(exc)})

        gateway = web.Application()
        gateway.router.add_post("/", gateway_handler)
        runner = web.AppRunner(gateway)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
        try:
            async with session.post(url, json={}) as reply:
                return reply.status, await reply.text(), received
        finally:
            await runner.cleanup()
            await upstream_runner.cleanup()


def run(
    answer: Answer, body: dict | None = None, upstream_port: int | None = None
) -> tuple[int, str, list[dict]]:
    return asyncio.run(through(answer, body or {"model": "ours", "messages": []}, upstream_port))


def test_the_names_are_swapped_both_ways():
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"model": "their-name", "choices": []})

    status, text, received = run(answer, {"model": "ours", "max_tokens": 3})
    assert status == 200 and json.loads(text) == {"model": "ours", "choices": []}
    assert received == [{"model": "their-name", "max_tokens": 3}]


def test_a_stream_is_relayed_chunk_by_chunk_renamed():
    async def answer(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for word in ("a", "b"):
            chunk = {"model": "their-name", "choices": [{"delta": {"content": word}}]}
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        return reply

    status, text, _ = run(answer)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [(c["model"], c["choices"][0]["delta"]["content"]) for c in chunks] == [
        ("ours", "a"),
        ("ours", "b"),
    ]


def test_a_stream_cut_after_its_first_chunk_ends_with_an_error_event():
    async def answer(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        chunk = {"model": "their-name", "choices": [{"delta": {"content": "a"}}]}
        await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # the upstream dies mid-stream
        return reply

    status, text, received = run(answer)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert status == 200 and len(received) == 1  # no second try after the first token
    assert events[0]["model"] == "ours"
    assert "cut off" in events[-1]["error"]["message"]


def test_a_client_error_passes_through():
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad temperature"}}, status=400)

    status, text, _ = run(answer)
    assert status == 400 and "bad temperature" in text


@pytest.mark.parametrize("code", [429, 500, 503])
def test_a_refusal_is_unavailable(code):
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=code, text="overloaded")

    status, text, _ = run(answer)
    assert status == 200 and json.loads(text)["unavailable"] == code
    assert "overloaded" in json.loads(text)["why"]


def test_nothing_listening_is_unavailable_at_once():
    async def never(request: web.Request) -> web.Response:
        raise AssertionError("nothing listens there")

    status, text, _ = run(never, upstream_port=free_port())
    assert status == 200 and json.loads(text)["unavailable"] == 502
