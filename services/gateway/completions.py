"""POST /v1/completions and /v1/chat/completions: parse → tokenize → submit → reply or stream."""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing

from aiohttp import web

from services.gateway.choices import Choices, merged_events
from services.gateway.errors import ApiError, invalid
from services.gateway.generation import Delta, Finish, GenerationFailed, Mesh, Submitted
from services.gateway.openai_schema import GenerationRequest, Kind, parse_request, with_max_tokens
from services.gateway.responses import ResponseBuilder, total_usage
from services.gateway.routed import routed_mesh
from services.gateway.sse import SSEWriter


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")


async def _handle(request: web.Request, kind: Kind) -> web.StreamResponse:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON") from None
    parsed = parse_request(kind, body)
    mesh = routed_mesh(request, parsed.model)  # the router's choice, or the one model
    config = mesh.config
    prompt_ids = _prompt_ids(mesh, parsed)
    sampling = with_max_tokens(parsed, len(prompt_ids), config.max_model_len)
    request_id = uuid.uuid4().hex
    choices = Choices(request_id, prompt_ids, sampling, parsed.stop, parsed.n)
    echo = _echo_text(mesh, parsed)
    builders = [
        ResponseBuilder(kind, request_id, config.served_model_name, mesh.text, index, echo)
        for index in range(parsed.n)
    ]
    first = await choices.submit(mesh, 0)
    try:
        if parsed.stream:
            return await _stream(request, mesh, choices, first, builders, parsed.include_usage)
        return await _complete(mesh, choices, first, builders)
    finally:
        await mesh.abandon(first)  # a no-op unless its events never ran to their end


def _prompt_ids(mesh: Mesh, parsed: GenerationRequest) -> list[int]:
    if parsed.messages is not None:
        return mesh.text.chat_prompt_ids(parsed.messages)
    assert parsed.prompt is not None  # parse_request sets one of the two
    return mesh.text.completion_prompt_ids(parsed.prompt, parsed.suffix)


def _echo_text(mesh: Mesh, parsed: GenerationRequest) -> str:
    """The prompt as text (without any fill-in-the-middle tokens), when a completion asks
    for echo; else nothing."""
    if not parsed.echo:
        return ""
    if isinstance(parsed.prompt, str):
        return parsed.prompt
    assert parsed.prompt is not None
    return mesh.text.tokenizer.decode(parsed.prompt, skip_special_tokens=False)


async def _complete(
    mesh: Mesh, choices: Choices, first: Submitted, builders: list[ResponseBuilder]
) -> web.Response:
    deltas: list[list[Delta]] = [[] for _ in builders]
    finishes: dict[int, Finish] = {}
    try:
        async with aclosing(merged_events(mesh, choices, first)) as events:
            async for index, event in events:
                if isinstance(event, Finish):
                    finishes[index] = event
                else:
                    deltas[index].append(event)
    except GenerationFailed as exc:
        raise ApiError(exc.status, str(exc), code="generation_failed") from None
    if len(finishes) < choices.n:
        raise ApiError(500, "the token stream ended without a finish", code="generation_failed")
    bodies = [b.full(deltas[i], finishes[i]) for i, b in enumerate(builders)]
    usage = total_usage([finishes[i] for i in range(choices.n)])
    entries = [body["choices"][0] for body in bodies]
    return web.json_response(bodies[0] | {"choices": entries, "usage": usage.as_dict()})


async def _stream(
    request: web.Request,
    mesh: Mesh,
    choices: Choices,
    first: Submitted,
    builders: list[ResponseBuilder],
    include_usage: bool,
) -> web.StreamResponse:
    """Client disconnect cancels this handler (handler_cancellation); Mesh.events then
    publishes Cancel as it closes."""
    sse = SSEWriter(request)
    await sse.start()
    opening = [True] * choices.n
    finishes: list[Finish] = []
    try:
        async with aclosing(merged_events(mesh, choices, first)) as events:
            async for index, event in events:
                builder = builders[index]
                if isinstance(event, Finish):
                    await sse.send(builder.chunk(None, event, opening[index]))
                    finishes.append(event)
                else:
                    await sse.send(builder.chunk(event, None, opening[index]))
                opening[index] = False
        if include_usage:
            await sse.send(builders[0].usage_chunk(total_usage(finishes)))
    except GenerationFailed as exc:
        await sse.send(ApiError(exc.status, str(exc), code="generation_failed").body())
    return await sse.done()
