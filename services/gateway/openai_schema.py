"""Parse and validate OpenAI request bodies into a GenerationRequest.

Decisions: `n` up to MAX_N choices (`choices.py`); `echo` (completions) returns the prompt
before the output, with logprobs its tokens scored first (the first has none);
`prompt_logprobs` (vLLM) scores the prompt tokens; `max_tokens: 0` (completions, with echo
or prompt_logprobs) scores the prompt and returns no output (the worker samples one token,
which is dropped); `suffix` (completions) asks
for fill-in-the-middle (`fim.py`), an empty one is the same as none. The strictness rule
(docs/API.md): a field OpenAI or vLLM documents either works or is a 400 naming it and
saying why (`vllm_fields.REFUSED`); any other field is a 400 naming it, unless its value is null.
Structured output (`response_format`, `structured_outputs`, `guided_*`) is parsed in
`structured.py`, tools in `tools.py`, messages and template options in `messages.py`.
SamplingParams does the range checks; its InvalidParameter.field maps back to the name
the client used. `max_tokens` is resolved against the prompt length in `with_max_tokens`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.body_fields import (
    bool_field,
    float_field,
    int_field,
    int_list_field,
    is_int,
)
from services.gateway.errors import invalid
from services.gateway.messages import (
    CHAT_OPTION_FIELDS,
    ChatOptions,
    Message,
    chat_options,
    parse_messages,
)
from services.gateway.structured import GUIDED_FIELDS, guided_fields
from services.gateway.tools import TOOL_FIELDS, ToolRequest, parse_tools
from services.gateway.vllm_fields import beam_search, refuse
from shared.engine.sampling_params import InvalidParameter, SamplingParams
from shared.models.generation_config import SamplingDefaults
from shared.wire_checks import PRIORITY_LIMIT

OPENAI_DEFAULTS = SamplingDefaults()  # a model without generation_config.json
_DEFAULTED = frozenset(f.name for f in dataclasses.fields(SamplingDefaults))

Kind = Literal["chat", "completion"]
MAX_STOP_STRINGS = 4
MAX_N = 16

_COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
        "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens", "logprobs",
        "stream", "stream_options", "user", "skip_special_tokens",
        "include_stop_str_in_output", "prompt_logprobs", "use_beam_search", "length_penalty",
        "priority",
        *GUIDED_FIELDS,
    }
)  # fmt: skip
_FIELDS: dict[Kind, frozenset[str]] = {
    "chat": _COMMON_FIELDS
    | {"messages", "max_completion_tokens", "top_logprobs", *TOOL_FIELDS, *CHAT_OPTION_FIELDS},
    "completion": _COMMON_FIELDS | {"prompt", "echo", "suffix"},
}
Prompt = str | list[int]
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    model: str
    messages: list[Message] | None  # chat: role, text content, tool calls
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
    tools: ToolRequest | None = None  # chat
    chat: ChatOptions = field(default_factory=ChatOptions)  # chat: template options
    skip_special_tokens: bool = True  # special tokens left out of the text
    include_stop_str: bool = False  # a matched stop string stays in the output
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    score_only: bool = False  # max_tokens 0: the prompt scored, no output
    prompt_logprobs_listed: bool = False  # prompt_logprobs asked (not only echo's logprobs)
    beam_search: bool = False  # use_beam_search: n beams (beam_search.py)
    length_penalty: float = 1.0
    unset: frozenset[str] = frozenset()  # sampling fields left out: a model's defaults apply
    priority: int = 0  # vLLM's: lower is served first when requests wait (the scheduler's)


def _priority(body: dict[str, Any]) -> int:
    """vLLM's `priority` (lower first): an integer of magnitude below 2**31."""
    priority = int_field(body, "priority", 0)
    if abs(priority) >= PRIORITY_LIMIT:
        raise invalid(f"priority must be in (-{PRIORITY_LIMIT}, {PRIORITY_LIMIT})", "priority")
    return priority


def parse_request(
    kind: Kind, body: Any, defaults: SamplingDefaults = OPENAI_DEFAULTS
) -> GenerationRequest:
    """Validate `body`; raises ApiError (400) naming the first offending field. Sampling
    fields the body leaves out take `defaults` (the model's generation_config.json)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    refuse(body)
    unsupported = sorted(set(body) - _FIELDS[kind])
    if unsupported:
        raise invalid(f"unsupported field(s): {', '.join(unsupported)}", unsupported[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required", "model")
    n = int_field(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}]", "n")
    suffix = body.get("suffix", "")
    if not isinstance(suffix, str):
        raise invalid("suffix must be a string", "suffix")
    echo = bool_field(body, "echo", False)
    prompt_logprobs = int_field(body, "prompt_logprobs", 0) if "prompt_logprobs" in body else None
    if echo and "logprobs" in body and prompt_logprobs is None:
        prompt_logprobs = int_field(body, "logprobs", 0)  # the echoed prompt is scored too
    max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(max_field, 16 if kind == "completion" else None)
    if max_tokens is not None:
        max_tokens = int_field(body, max_field, max_tokens)
    score_only = max_tokens == 0
    if score_only and not (kind == "completion" and (echo or prompt_logprobs is not None)):
        raise invalid(f"{max_field}=0 needs a completion with echo or prompt_logprobs", max_field)
    if score_only:
        max_tokens = 1  # the one token the worker samples is dropped
    stream = bool_field(body, "stream", False)
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - _STREAM_OPTIONS:
        raise invalid(
            "stream_options may only hold include_usage and continuous_usage_stats",
            "stream_options",
        )
    if options and not stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")
    include_usage = bool_field(options, "include_usage", False)
    logprobs, logprobs_field = _logprobs(kind, body)
    guided_kind, guided_spec = guided_fields(body)
    tools = parse_tools(body) if kind == "chat" else None
    if tools is not None and tools.guided()[0]:
        if guided_kind:
            name = next(f for f in GUIDED_FIELDS if f in body)
            raise invalid(f"tool_choice {tools.choice!r} cannot be combined with {name}", name)
        guided_kind, guided_spec = tools.guided()
    messages = parse_messages(body) if kind == "chat" else None
    try:
        sampling = SamplingParams(
            temperature=float_field(body, "temperature", defaults.temperature),
            top_p=float_field(body, "top_p", defaults.top_p),
            top_k=int_field(body, "top_k", defaults.top_k),
            min_p=float_field(body, "min_p", defaults.min_p),
            repetition_penalty=float_field(body, "repetition_penalty", defaults.repetition_penalty),
            frequency_penalty=float_field(body, "frequency_penalty", 0.0),
            presence_penalty=float_field(body, "presence_penalty", 0.0),
            logit_bias=_logit_bias(body),
            seed=int_field(body, "seed", 0) if "seed" in body else None,
            stop_token_ids=tuple(int_list_field(body, "stop_token_ids")),
            ignore_eos=bool_field(body, "ignore_eos", False),
            min_tokens=int_field(body, "min_tokens", 0),
            max_tokens=max_tokens if max_tokens is not None else _placeholder_max(body),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            guided_kind=guided_kind,
            guided_spec=guided_spec,
        )
    except InvalidParameter as exc:
        raise _field_error(exc, max_field, logprobs_field) from None
    return GenerationRequest(
        kind=kind,
        model=model,
        messages=messages,
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
        tools=tools,
        chat=chat_options(body, messages) if messages else ChatOptions(),
        skip_special_tokens=bool_field(body, "skip_special_tokens", True),
        include_stop_str=bool_field(body, "include_stop_str_in_output", False),
        continuous_usage=bool_field(options, "continuous_usage_stats", False),
        score_only=score_only,
        prompt_logprobs_listed="prompt_logprobs" in body,
        beam_search=beam_search(body, n, tools),
        length_penalty=float_field(body, "length_penalty", 1.0),
        unset=_DEFAULTED.difference(body),
        priority=_priority(body),
    )


def with_defaults(request: GenerationRequest, defaults: SamplingDefaults) -> GenerationRequest:
    """`request` with the sampling fields its body left out set to `defaults` (a model's
    generation_config.json): what `parse_request(kind, body, defaults)` gives."""
    values = {k: v for k, v in dataclasses.asdict(defaults).items() if k in request.unset}
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, **values))


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
    return max(1, int_field(body, "min_tokens", 1))


def _logprobs(kind: Kind, body: dict[str, Any]) -> tuple[int | None, str]:
    if kind == "completion":
        return (int_field(body, "logprobs", 0) if "logprobs" in body else None), "logprobs"
    wanted = bool_field(body, "logprobs", False)
    if "top_logprobs" in body and not wanted:
        raise invalid("top_logprobs requires logprobs=true", "top_logprobs")
    return (int_field(body, "top_logprobs", 0) if wanted else None), "top_logprobs"


def _prompt(body: dict[str, Any]) -> Prompt:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
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
        return {int(k): float_field(bias, k, 0.0, "logit_bias") for k in bias}
    except ValueError:
        raise invalid("logit_bias keys must be token ids", "logit_bias") from None
