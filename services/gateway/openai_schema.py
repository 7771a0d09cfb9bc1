"""Parse and validate OpenAI request bodies into a GenerationRequest.

Decisions: `n` up to MAX_N choices (`choices.py`); `echo` (completions) returns the prompt
before the output, but not with logprobs (no prompt logprobs); `suffix` (completions) asks
for fill-in-the-middle (`fim.py`), an empty one is the same as none; any field outside the
accepted set (tools, functions, audio, ...) is a 400 naming it, unless its value is null.
Structured output (`response_format`, `guided_*`) is parsed in `structured.py`.
SamplingParams does the range checks; its InvalidParameter.field maps back to the name
the client used. `max_tokens` is resolved against the prompt length in `with_max_tokens`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from services.gateway.errors import invalid
from services.gateway.structured import GUIDED_FIELDS, guided_fields
from shared.engine.sampling_params import InvalidParameter, SamplingParams
from shared.models.generation_config import SamplingDefaults

OPENAI_DEFAULTS = SamplingDefaults()  # a model without generation_config.json

Kind = Literal["chat", "completion"]
MAX_STOP_STRINGS = 4
MAX_N = 16

_COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
        "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens", "logprobs",
        "stream", "stream_options", "user", *GUIDED_FIELDS,
    }
)  # fmt: skip
_FIELDS: dict[Kind, frozenset[str]] = {
    "chat": _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"},
    "completion": _COMMON_FIELDS | {"prompt", "echo", "suffix"},
}
Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    model: str
    messages: list[dict[str, str]] | None  # chat: role and text content
    prompt: Prompt | None  # completions: text or token ids
    sampling: SamplingParams  # max_tokens is a placeholder until with_max_tokens
    max_tokens: int | None  # None: as many as the context allows
    max_tokens_field: str  # the name the client used, for error messages
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1  # choices, each its own request on the mesh
    echo: bool = False  # completions: the prompt's text comes before the output
    suffix: str = ""  # completions: the text after the output (fill-in-the-middle)


def parse_request(
    kind: Kind, body: Any, defaults: SamplingDefaults = OPENAI_DEFAULTS
) -> GenerationRequest:
    """Validate `body`; raises ApiError (400) naming the first offending field. Sampling
    fields the body leaves out take `defaults` (the model's generation_config.json)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    unsupported = sorted(set(body) - _FIELDS[kind])
    if unsupported:
        raise invalid(f"unsupported field(s): {', '.join(unsupported)}", unsupported[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required", "model")
    n = _int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}]", "n")
    suffix = body.get("suffix", "")
    if not isinstance(suffix, str):
        raise invalid("suffix must be a string", "suffix")
    echo = _bool(body, "echo", False)
    if echo and "logprobs" in body:
        raise invalid("echo with logprobs is not supported (no prompt logprobs)", "echo")
    max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(max_field, 16 if kind == "completion" else None)
    if max_tokens is not None:
        max_tokens = _int(body, max_field, max_tokens)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("stream_options may only hold include_usage", "stream_options")
    if options and not stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")
    include_usage = _bool(options, "include_usage", False)
    logprobs, logprobs_field = _logprobs(kind, body)
    guided_kind, guided_spec = guided_fields(body)
    try:
        sampling = SamplingParams(
            temperature=_float(body, "temperature", defaults.temperature),
            top_p=_float(body, "top_p", defaults.top_p),
            top_k=_int(body, "top_k", defaults.top_k),
            min_p=_float(body, "min_p", defaults.min_p),
            repetition_penalty=_float(body, "repetition_penalty", defaults.repetition_penalty),
            frequency_penalty=_float(body, "frequency_penalty", 0.0),
            presence_penalty=_float(body, "presence_penalty", 0.0),
            logit_bias=_logit_bias(body),
            seed=_int(body, "seed", 0) if "seed" in body else None,
            stop_token_ids=tuple(_int_list(body, "stop_token_ids")),
            ignore_eos=_bool(body, "ignore_eos", False),
            min_tokens=_int(body, "min_tokens", 0),
            max_tokens=max_tokens if max_tokens is not None else _placeholder_max(body),
            logprobs=logprobs,
            guided_kind=guided_kind,
            guided_spec=guided_spec,
        )
    except InvalidParameter as exc:
        raise _field_error(exc, max_field, logprobs_field) from None
    return GenerationRequest(
        kind=kind,
        model=model,
        messages=_messages(body) if kind == "chat" else None,
        prompt=_prompt(body) if kind == "completion" else None,
        sampling=sampling,
        max_tokens=max_tokens,
        max_tokens_field=max_field,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        n=n,
        echo=echo,
        suffix=suffix,
    )


def with_max_tokens(
    request: GenerationRequest, num_prompt: int, max_model_len: int
) -> SamplingParams:
    """The SamplingParams with max_tokens fitted to the context; 400 if it does not fit."""
    prompt_field = "messages" if request.kind == "chat" else "prompt"
    if num_prompt >= max_model_len:
        raise invalid(
            f"the prompt is {num_prompt} tokens; this model's context is {max_model_len}",
            prompt_field,
        )
    if request.max_tokens is None:
        max_tokens = max_model_len - num_prompt
    elif num_prompt + request.max_tokens > max_model_len:
        raise invalid(
            f"{request.max_tokens_field}={request.max_tokens} plus the prompt's {num_prompt} "
            f"tokens exceeds this model's context of {max_model_len}",
            request.max_tokens_field,
        )
    else:
        max_tokens = request.max_tokens
    try:
        return dataclasses.replace(request.sampling, max_tokens=max_tokens)
    except InvalidParameter as exc:
        raise _field_error(exc, request.max_tokens_field, "logprobs") from None


def _field_error(exc: InvalidParameter, max_field: str, logprobs_field: str) -> Exception:
    name = {"max_tokens": max_field, "logprobs": logprobs_field}.get(exc.field, exc.field)
    return invalid(f"{name} {str(exc).removeprefix(exc.field).strip()}", name)


def _placeholder_max(body: dict[str, Any]) -> int:
    # Until the prompt is tokenized: the smallest value min_tokens allows.
    return max(1, _int(body, "min_tokens", 1))


def _logprobs(kind: Kind, body: dict[str, Any]) -> tuple[int | None, str]:
    if kind == "completion":
        return (_int(body, "logprobs", 0) if "logprobs" in body else None), "logprobs"
    wanted = _bool(body, "logprobs", False)
    if "top_logprobs" in body and not wanted:
        raise invalid("top_logprobs requires logprobs=true", "top_logprobs")
    return (_int(body, "top_logprobs", 0) if wanted else None), "top_logprobs"


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"{where} must be an object with a role", where)
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise invalid(f"{where}: unsupported field(s): {', '.join(extra)}", where)
        out.append({"role": message["role"], "content": _content(message.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(f"{where}.content must be a string or a list of text parts", where)


def _prompt(body: dict[str, Any]) -> Prompt:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return prompt
    raise invalid("prompt must be a non-empty string or a list of token ids (one prompt)", "prompt")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise invalid("stop must be a string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(stop)


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    bias = body.get("logit_bias", {})
    if not isinstance(bias, dict):
        raise invalid("logit_bias must map token ids to numbers", "logit_bias")
    try:
        return {int(k): _float(bias, k, 0.0, "logit_bias") for k in bias}
    except ValueError:
        raise invalid("logit_bias keys must be token ids", "logit_bias") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if not _is_int(value):
        raise invalid(f"{name} must be an integer", name)
    return value


def _int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name, [])
    if not (isinstance(value, list) and all(_is_int(v) for v in value)):
        raise invalid(f"{name} must be a list of integers", name)
    return value


def _float(body: dict[str, Any], name: str, default: float, param: str | None = None) -> float:
    value = body.get(name, default)
    if not (isinstance(value, int | float) and not isinstance(value, bool)):
        raise invalid(f"{param or name} must be a number", param or name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false", name)
    return value
