"""Request parsing: OpenAI bodies → SamplingParams, and every 400 names its field."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.errors import ApiError
from services.gateway.openai_schema import parse_request, with_max_tokens

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def error_of(kind: str, body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(kind, body)
    assert info.value.status == 400
    return info.value


def test_chat_fields_map_to_sampling_params() -> None:
    parsed = parse_request(
        "chat",
        CHAT
        | {
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 5,
            "min_p": 0.1,
            "seed": 0,
            "stop": "x",
            "stop_token_ids": [3],
            "logit_bias": {"12": -100},
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "ignored",
            "tools": None,
        },
    )
    s = parsed.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (7, 0.0, 0.5, 5, 0.1)
    assert (s.seed, s.stop_token_ids, s.logit_bias, s.logprobs) == (0, (3,), {12: -100.0}, 2)
    assert parsed.stop == ("x",) and parsed.stream and parsed.include_usage
    assert parsed.max_tokens_field == "max_completion_tokens"


def test_completion_prompt_forms_and_defaults() -> None:
    assert parse_request("completion", COMPLETION).max_tokens == 16
    assert parse_request("completion", COMPLETION | {"prompt": ["hi"]}).prompt == "hi"
    assert parse_request("completion", COMPLETION | {"prompt": [1, 2]}).prompt == [1, 2]
    assert parse_request("completion", COMPLETION | {"prompt": [[1, 2]]}).prompt == [1, 2]
    assert parse_request("completion", COMPLETION | {"logprobs": 3}).sampling.logprobs == 3
    assert parse_request("chat", CHAT).max_tokens is None


def test_chat_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parsed = parse_request("chat", CHAT | {"messages": [{"role": "user", "content": parts}]})
    assert parsed.messages == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("chat", [], None),
        ("chat", {"messages": CHAT["messages"]}, "model"),
        ("chat", CHAT | {"max_tokens": -1}, "max_tokens"),
        ("chat", CHAT | {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("chat", CHAT | {"temperature": 5}, "temperature"),
        ("chat", CHAT | {"temperature": "hot"}, "temperature"),
        ("chat", CHAT | {"top_p": 0}, "top_p"),
        ("chat", CHAT | {"frequency_penalty": 3}, "frequency_penalty"),
        ("chat", CHAT | {"repetition_penalty": 0}, "repetition_penalty"),
        ("chat", CHAT | {"seed": -1}, "seed"),
        ("chat", CHAT | {"n": 17}, "n"),
        ("chat", CHAT | {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("chat", CHAT | {"stop": [""]}, "stop"),
        ("chat", CHAT | {"logit_bias": {"x": 1}}, "logit_bias"),
        ("chat", CHAT | {"logit_bias": {"1": 500}}, "logit_bias"),
        ("chat", CHAT | {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("chat", CHAT | {"top_logprobs": 2}, "top_logprobs"),
        ("chat", CHAT | {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ("chat", CHAT | {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", CHAT | {"tools": [{"type": "function"}]}, "tools"),
        ("chat", CHAT | {"response_format": {"type": "yaml"}}, "response_format"),
        ("chat", CHAT | {"messages": []}, "messages"),
        ("chat", CHAT | {"messages": [{"content": "no role"}]}, "messages[0]"),
        ("chat", CHAT | {"messages": [{"role": "user", "content": 3}]}, "messages[0]"),
        ("completion", COMPLETION | {"prompt": ""}, "prompt"),
        ("completion", COMPLETION | {"prompt": ["a", "b"]}, "prompt"),
        ("completion", COMPLETION | {"prompt": [1, -2]}, "prompt"),
        ("completion", COMPLETION | {"logprobs": 21}, "logprobs"),
        ("completion", COMPLETION | {"messages": []}, "messages"),
        ("completion", COMPLETION | {"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_errors_name_the_field(kind: str, body: Any, param: str | None) -> None:
    error = error_of(kind, body)
    assert error.param == param
    assert error.body()["error"]["type"] == "invalid_request_error"
    if param:
        assert param in error.message


def test_max_tokens_fitted_to_the_context() -> None:
    chat = parse_request("chat", CHAT)
    assert with_max_tokens(chat, 10, 100).max_tokens == 90
    assert with_max_tokens(parse_request("chat", CHAT | {"max_tokens": 90}), 10, 100).max_tokens
    with pytest.raises(ApiError) as info:
        with_max_tokens(parse_request("chat", CHAT | {"max_tokens": 91}), 10, 100)
    assert info.value.param == "max_tokens"
    with pytest.raises(ApiError) as info:
        with_max_tokens(chat, 100, 100)
    assert info.value.param == "messages"
    with pytest.raises(ApiError) as info:
        with_max_tokens(parse_request("completion", COMPLETION), 100, 100)
    assert info.value.param == "prompt"
