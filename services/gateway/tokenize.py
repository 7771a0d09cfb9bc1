"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version, GET|POST /ping.

/tokenize takes vLLM's two shapes: a completion form `{prompt, add_special_tokens=true}` and
a chat form `{messages, add_generation_prompt=true, continue_final_message, tools,
chat_template_kwargs, add_special_tokens=false}` rendered exactly as /v1/chat/completions
renders it; both may ask `return_token_strs`. The reply is `{count, max_model_len, tokens,
token_strs}`. /detokenize turns `{tokens}` into `{prompt}`. `model`, when given, must be the
served model. Both need the API key, as /v1/* does.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from aiohttp import web

from services.gateway.body_fields import bool_field
from services.gateway.errors import ApiError, invalid
from services.gateway.keys import CLIENT, CONFIG
from services.gateway.messages import CHAT_OPTION_FIELDS, chat_options, parse_messages
from services.gateway.request_body import json_body
from services.gateway.tools import TOOL_FIELDS, parse_tools

_COMMON = {"model", "add_special_tokens", "return_token_strs"}
_CHAT = _COMMON | {"messages", *CHAT_OPTION_FIELDS, *TOOL_FIELDS}
_PROMPT = _COMMON | {"prompt"}


async def tokenize(request: web.Request) -> web.Response:
    config, text = request.app[CONFIG], request.app[CLIENT].text
    body = _dict(await json_body(request))
    chat = "messages" in body
    body = _checked(request, body, _CHAT if chat else _PROMPT)
    add_special = bool_field(body, "add_special_tokens", not chat)
    if chat:
        messages = parse_messages(body)
        prompt = text.chat_prompt(messages, parse_tools(body), chat_options(body, messages))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("prompt must be a string (or send messages)", "prompt")
    ids = text.tokenizer.encode(prompt, add_special_tokens=add_special).ids
    wants_strs = bool_field(body, "return_token_strs", False)
    strs = [text.token_text(i) for i in ids] if wants_strs else None
    return web.json_response(
        {
            "count": len(ids),
            "max_model_len": config.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    text = request.app[CLIENT].text
    body = _checked(request, await json_body(request), {"model", "tokens"})
    tokens = body.get("tokens")
    if not (
        isinstance(tokens, list)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < text.vocab_size
                for t in tokens)
    ):  # fmt: skip
        raise invalid(f"tokens must be a list of token ids below {text.vocab_size}", "tokens")
    return web.json_response({"prompt": text.tokenizer.decode(tokens, skip_special_tokens=False)})


async def server_version(request: web.Request) -> web.Response:
    try:
        number = version("splitserve")
    except PackageNotFoundError:
        number = "unknown"
    return web.json_response({"version": number})


async def ping(request: web.Request) -> web.Response:
    return web.Response(status=200)


def _dict(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _checked(request: web.Request, body: Any, allowed: set[str]) -> dict[str, Any]:
    body = {k: v for k, v in _dict(body).items() if v is not None}
    unsupported = sorted(set(body) - allowed)
    if unsupported:
        raise invalid(f"unsupported field(s): {', '.join(unsupported)}", unsupported[0])
    model = body.get("model", request.app[CONFIG].served_model_name)
    if model != request.app[CONFIG].served_model_name:
        raise ApiError(
            400, f"model {model!r} does not exist", param="model", code="model_not_found"
        )
    return body
