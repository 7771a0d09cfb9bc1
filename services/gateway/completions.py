"""POST /v1/completions and /v1/chat/completions: parse → tokenize → submit → reply or stream."""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from services.gateway.beam_search import beam_search
from services.gateway.choices import Choices, merged_events
from services.gateway.errors import ApiError, invalid
from services.gateway.generation import (
    Delta,
    Finish,
    GenerationFailed,
    Mesh,
    OutputText,
    Submitted,
    Usage,
)
from services.gateway.openai_schema import GenerationRequest, Kind, parse_request, with_max_tokens
from services.gateway.prompt_scores import PromptScoring
from services.gateway.responses import ResponseBuilder, total_usage
from services.gateway.routed import routed_mesh, serving_mesh
from services.gateway.sse import SSEWriter
from services.gateway.tool_stream import ToolCallStream


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")


async def _handle(request: web.Request, kind: Kind) -> web.StreamResponse:
    body = await json_body(request)
    parsed = parse_request(kind, body, serving_mesh(request).text.sampling_defaults)
    mesh, choices = prepare(request, parsed)  # the router's choice, or the one model
    config = mesh.config
    echo = _echo_text(mesh, parsed)
    usage_so_far = len(choices.prompt_ids) if parsed.continuous_usage else None
    builders = [
        ResponseBuilder(
            kind,
            choices.request_id,
            config.served_model_name,
            mesh.text,
            index,
            echo,
            tool_stream(mesh, parsed),
            usage_so_far,
            _scoring(parsed, choices.prompt_ids),
        )
        for index in range(parsed.n)
    ]
    if parsed.beam_search:
        return await _beams(mesh, parsed, choices, builders)
    first = await choices.submit(mesh, 0)
    try:
        if parsed.stream:
            return await _stream(request, mesh, choices, first, builders, parsed.include_usage)
        return await _complete(mesh, choices, first, builders)
    finally:
        await mesh.abandon(first)  # a no-op unless its events never ran to their end


async def json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON") from None


def prepare(request: web.Request, parsed: GenerationRequest) -> tuple[Mesh, Choices]:
    """The mesh of the request's model (400 for a model not served), and what each choice
    submits there: the tokenized prompt and max_tokens fitted."""
    mesh = routed_mesh(request, parsed.model)
    config = mesh.config
    prompt_ids = _prompt_ids(mesh, parsed)
    sampling = with_max_tokens(parsed, len(prompt_ids), config.max_model_len)
    tools = parsed.tools is not None and parsed.tools.active
    keep = mesh.text.tool_markers(config.tool_call_parser) if tools else ()
    output = OutputText(parsed.skip_special_tokens, parsed.include_stop_str, frozenset(keep))
    return mesh, Choices(uuid.uuid4().hex, prompt_ids, sampling, parsed.stop, parsed.n, output)


def tool_stream(mesh: Mesh, parsed: GenerationRequest) -> ToolCallStream | None:
    """A parser for one choice's tool calls, when the request has active tools."""
    if parsed.tools is None or not parsed.tools.active:
        return None
    parser = mesh.text.tool_parser(mesh.config.tool_call_parser)
    return parsed.tools.stream(parser)


def _scoring(parsed: GenerationRequest, prompt_ids: list[int]) -> PromptScoring | None:
    """What the reply shows of the prompt's logprobs, when the request scores its prompt."""
    sampling = parsed.sampling
    if sampling.prompt_logprobs is None:
        return None
    echoed = parsed.echo and sampling.logprobs is not None
    listed = parsed.prompt_logprobs_listed
    return PromptScoring(prompt_ids[0], listed, echoed, parsed.score_only)


def _prompt_ids(mesh: Mesh, parsed: GenerationRequest) -> list[int]:
    if parsed.messages is not None:
        return mesh.text.chat_prompt_ids(parsed.messages, parsed.tools, parsed.chat)
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
    usage = total_usage([b.finished(finishes[i]) for i, b in enumerate(builders)])
    entries = [body["choices"][0] for body in bodies]
    return web.json_response(bodies[0] | {"choices": entries, "usage": usage.as_dict()})


async def _beams(
    mesh: Mesh, parsed: GenerationRequest, choices: Choices, builders: list[ResponseBuilder]
) -> web.Response:
    """use_beam_search: the n best beams are the choices, best first (beam_search.py)."""
    beams = await beam_search(
        mesh, choices.request_id, choices.prompt_ids, choices.sampling, parsed.n,
        parsed.length_penalty,
    )  # fmt: skip
    decode = mesh.text.tokenizer.decode
    bodies, finishes = [], []
    for beam, builder in zip(beams, builders, strict=False):
        text = decode(list(beam.token_ids), skip_special_tokens=parsed.skip_special_tokens)
        finish = Finish("stop" if beam.ended else "length",
                        Usage(len(choices.prompt_ids), len(beam.token_ids)))  # fmt: skip
        bodies.append(builder.full([Delta(text, list(beam.token_ids))], finish))
        finishes.append(finish)
    entries = [body["choices"][0] for body in bodies]
    usage = total_usage(finishes).as_dict()
    return web.json_response(bodies[0] | {"choices": entries, "usage": usage})


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
                    finishes.append(builder.finished(event))
                else:
                    await sse.send(builder.chunk(event, None, opening[index]))
                opening[index] = False
        if include_usage:
            await sse.send(builders[0].usage_chunk(total_usage(finishes)))
    except GenerationFailed as exc:
        await sse.send(ApiError(exc.status, str(exc), code="generation_failed").body())
    return await sse.done()
