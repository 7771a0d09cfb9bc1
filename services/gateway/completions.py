"""One model's answer to a completion or chat request: prepare → submit → reply or stream.

`generate` serves a body (read and parsed once, request_body.py) on one model's client;
the route handler (chain.py) picks the model. Subtle rule: a refusal, and a failure before
the reply started, leave here as domain values (refusals.py) so the caller can try the next
target; only a failure after the stream started is written here, as an SSE error event.
"""

from __future__ import annotations

import uuid
from contextlib import aclosing

from aiohttp import web

from services.gateway.adapters import adapter_client
from services.gateway.beam_search import beam_search
from services.gateway.choices import Choices, merged_events
from services.gateway.errors import ApiError, api_error
from services.gateway.gateway_request import GatewayRequest, OutputText
from services.gateway.keys import CLIENT
from services.gateway.model_client import ModelClient
from services.gateway.openai_schema import GenerationRequest, with_max_tokens
from services.gateway.prompt_scores import PromptScoring
from services.gateway.refusals import GenerationFailed
from services.gateway.request_body import RequestBody
from services.gateway.responses import ResponseBuilder, total_usage
from services.gateway.sse import SSEWriter
from services.gateway.token_events import Delta, Finish, Usage
from services.gateway.tool_stream import ToolCallStream
from shared.engine.lora.modules import adapter_name_error


async def generate(
    request: web.Request, client: ModelClient, body: RequestBody, has_fallback: bool = False
) -> web.StreamResponse:
    """Serve `body` on `client`'s model. Refused (nothing sent yet) and, for a reply not
    yet started, GenerationFailed leave to the caller (chain.py), which may try another."""
    parsed, choices = prepare(client, body, has_fallback)
    kind, config = parsed.kind, client.config
    echo = _echo_text(client, parsed)
    usage_so_far = len(choices.prompt_ids) if parsed.continuous_usage else None
    builders = [
        ResponseBuilder(
            kind,
            choices.request_id,
            config.served_model_name,
            client.text,
            index,
            echo,
            tool_stream(client, parsed),
            usage_so_far,
            _scoring(parsed, choices.prompt_ids),
        )
        for index in range(parsed.n)
    ]
    if parsed.beam_search:
        return await _beams(client, parsed, choices, builders)
    first = await choices.submit(client, 0)
    try:
        if parsed.stream:
            return await _stream(request, client, choices, first, builders, parsed.include_usage)
        return await _complete(client, choices, first, builders)
    finally:
        await client.abandon(first)  # a no-op unless its events never ran to their end


async def own_model(request: web.Request, body: RequestBody) -> ModelClient:
    """The gateway's own model, or one of its LoRA adapters (adapters.py), which the body
    must call (400 naming `model` otherwise)."""
    client = request.app[CLIENT]
    model = body.parsed().model
    if model == client.config.served_model_name:
        return client
    adapter = await adapter_client(request, model) if adapter_name_error(model) is None else None
    if adapter is None:
        raise ApiError(
            400, f"model {model!r} does not exist", param="model", code="model_not_found"
        )
    return adapter


def prepare(
    client: ModelClient, body: RequestBody, has_fallback: bool = False
) -> tuple[GenerationRequest, Choices]:
    """The request with the model's defaults, and what each choice submits to the model:
    the tokenized prompt and max_tokens fitted."""
    config = client.config
    parsed = body.for_model(client.text)
    prompt_ids = body.prompt_ids(config.served_model_name, client.text)
    sampling = with_max_tokens(parsed, len(prompt_ids), config.max_model_len)
    tools = parsed.tools is not None and parsed.tools.active
    keep = client.text.tool_markers(config.tool_call_parser) if tools else ()
    output = OutputText(parsed.skip_special_tokens, parsed.include_stop_str, frozenset(keep))
    request_id = uuid.uuid4().hex
    choices = Choices(
        request_id,
        prompt_ids,
        sampling,
        parsed.stop,
        parsed.n,
        output,
        has_fallback,
        body.tenant,
        parsed.priority,
    )
    return parsed, choices


def tool_stream(client: ModelClient, parsed: GenerationRequest) -> ToolCallStream | None:
    """A parser for one choice's tool calls, when the request has active tools."""
    if parsed.tools is None or not parsed.tools.active:
        return None
    parser = client.text.tool_parser(client.config.tool_call_parser)
    return parsed.tools.stream(parser)


def _scoring(parsed: GenerationRequest, prompt_ids: list[int]) -> PromptScoring | None:
    """What the reply shows of the prompt's logprobs, when the request scores its prompt."""
    sampling = parsed.sampling
    if sampling.prompt_logprobs is None:
        return None
    echoed = parsed.echo and sampling.logprobs is not None
    listed = parsed.prompt_logprobs_listed
    return PromptScoring(prompt_ids[0], listed, echoed, parsed.score_only)


def _echo_text(client: ModelClient, parsed: GenerationRequest) -> str:
    """The prompt as text (without any fill-in-the-middle tokens), when a completion asks
    for echo; else nothing."""
    if not parsed.echo:
        return ""
    if isinstance(parsed.prompt, str):
        return parsed.prompt
    assert parsed.prompt is not None
    return client.text.tokenizer.decode(parsed.prompt, skip_special_tokens=False)


async def _complete(
    client: ModelClient, choices: Choices, first: GatewayRequest, builders: list[ResponseBuilder]
) -> web.Response:
    deltas: list[list[Delta]] = [[] for _ in builders]
    finishes: dict[int, Finish] = {}
    async with aclosing(merged_events(client, choices, first)) as events:
        async for index, event in events:
            if isinstance(event, Finish):
                finishes[index] = event
            else:
                deltas[index].append(event)
    if len(finishes) < choices.n:
        raise ApiError(500, "the token stream ended without a finish", code="generation_failed")
    bodies = [b.full(deltas[i], finishes[i]) for i, b in enumerate(builders)]
    usage = total_usage([b.finished(finishes[i]) for i, b in enumerate(builders)])
    entries = [body["choices"][0] for body in bodies]
    return web.json_response(bodies[0] | {"choices": entries, "usage": usage.as_dict()})


async def _beams(
    client: ModelClient,
    parsed: GenerationRequest,
    choices: Choices,
    builders: list[ResponseBuilder],
) -> web.Response:
    """use_beam_search: the n best beams are the choices, best first (beam_search.py)."""
    beams = await beam_search(client, choices.spec_of(0), parsed.n, parsed.length_penalty)
    decode = client.text.tokenizer.decode
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
    client: ModelClient,
    choices: Choices,
    first: GatewayRequest,
    builders: list[ResponseBuilder],
    include_usage: bool,
) -> web.StreamResponse:
    """Client disconnect cancels this handler (handler_cancellation); token_events then
    publishes Cancel as it closes."""
    sse = SSEWriter(request)
    await sse.start()
    opening = [True] * choices.n
    finishes: list[Finish] = []
    try:
        async with aclosing(merged_events(client, choices, first)) as events:
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
        await sse.send(api_error(exc).body())
    return await sse.done()
