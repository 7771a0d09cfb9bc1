"""POST /v1/completions and /v1/chat/completions: parse → tokenize → submit → reply or stream."""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing

from aiohttp import web

from services.gateway.errors import ApiError, invalid
from services.gateway.generation import Delta, Finish, GenerationFailed, Mesh, Submitted
from services.gateway.keys import CONFIG, MESH
from services.gateway.openai_schema import GenerationRequest, Kind, parse_request, with_max_tokens
from services.gateway.responses import ResponseBuilder
from services.gateway.sse import SSEWriter


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")


async def _handle(request: web.Request, kind: Kind) -> web.StreamResponse:
    config, mesh = request.app[CONFIG], request.app[MESH]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON") from None
    parsed = parse_request(kind, body)
    if parsed.model != config.served_model_name:
        raise ApiError(
            400, f"model {parsed.model!r} does not exist", param="model", code="model_not_found"
        )
    prompt_ids = _prompt_ids(mesh, parsed)
    sampling = with_max_tokens(parsed, len(prompt_ids), config.max_model_len)
    request_id = uuid.uuid4().hex
    job = await mesh.submit(request_id, prompt_ids, sampling, parsed.stop)
    builder = ResponseBuilder(kind, request_id, config.served_model_name, mesh.text)
    if parsed.stream:
        return await _stream(request, mesh, job, builder, parsed.include_usage)
    return await _complete(mesh, job, builder)


def _prompt_ids(mesh: Mesh, parsed: GenerationRequest) -> list[int]:
    if parsed.messages is not None:
        return mesh.text.chat_prompt_ids(parsed.messages)
    assert parsed.prompt is not None  # parse_request sets one of the two
    return mesh.text.completion_prompt_ids(parsed.prompt)


async def _complete(mesh: Mesh, job: Submitted, builder: ResponseBuilder) -> web.Response:
    deltas: list[Delta] = []
    try:
        async with aclosing(mesh.events(job)) as events:
            async for event in events:
                if isinstance(event, Finish):
                    return web.json_response(builder.full(deltas, event))
                deltas.append(event)
    except GenerationFailed as exc:
        raise ApiError(exc.status, str(exc), code="generation_failed") from None
    raise ApiError(500, "the token stream ended without a finish", code="generation_failed")


async def _stream(
    request: web.Request,
    mesh: Mesh,
    job: Submitted,
    builder: ResponseBuilder,
    include_usage: bool,
) -> web.StreamResponse:
    """Client disconnect cancels this handler (handler_cancellation); Mesh.events then
    publishes Cancel as it closes."""
    sse = SSEWriter(request)
    await sse.start()
    first = True
    try:
        async with aclosing(mesh.events(job)) as events:
            async for event in events:
                if isinstance(event, Finish):
                    await sse.send(builder.chunk(None, event, first))
                    if include_usage:
                        await sse.send(builder.usage_chunk(event))
                else:
                    await sse.send(builder.chunk(event, None, first))
                first = False
    except GenerationFailed as exc:
        await sse.send(ApiError(exc.status, str(exc), code="generation_failed").body())
    return await sse.done()
