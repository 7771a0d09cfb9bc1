"""vLLM's request fields on the gateway: structured_outputs and its guided_* aliases, the
chat-template options, the refused fields, beam search's conflicts, prompt logprobs and
max_tokens 0, and the Responses API's translation to a chat body."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.errors import ApiError
from services.gateway.openai_schema import parse_request
from services.gateway.responses_input import chat_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def param_of(kind: str, body: dict[str, Any]) -> str | None:
    with pytest.raises(ApiError) as info:
        parse_request(kind, body)
    assert info.value.status == 400
    return info.value.param


@pytest.mark.parametrize(
    ("structured", "alias", "kind", "spec"),
    [
        ({"json": {"type": "object"}}, {"guided_json": {"type": "object"}}, "json_schema",
         '{"type": "object"}'),
        ({"regex": "a+"}, {"guided_regex": "a+"}, "regex", "a+"),
        ({"choice": ["x", "y"]}, {"guided_choice": ["x", "y"]}, "choice", '["x", "y"]'),
        ({"grammar": "root ::= 'a'"}, {"guided_grammar": "root ::= 'a'"}, "grammar",
         "root ::= 'a'"),
        ({"json_object": True}, {"response_format": {"type": "json_object"}}, "json_object", ""),
    ],
)  # fmt: skip
def test_structured_outputs_equal_their_aliases(
    structured: dict[str, Any], alias: dict[str, Any], kind: str, spec: str
) -> None:
    for extra in ({"structured_outputs": structured}, alias):
        sampling = parse_request("completion", COMPLETION | extra).sampling
        assert (sampling.guided_kind, sampling.guided_spec) == (kind, spec)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(?=a)"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": {"type": "thing"}}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "guided_regex"),
        ({"priority": "high"}, "priority"),
        ({"priority": 2**31}, "priority"),
        ({"cache_salt": "s"}, "cache_salt"),
        ({"best_of": 2}, "best_of"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),  # no stream
        ({"max_tokens": 0}, "max_tokens"),  # neither echo nor prompt_logprobs
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"use_beam_search": True, "stream": True}, "stream"),
        ({"use_beam_search": True, "n": 11}, "n"),
        ({"use_beam_search": True, "logprobs": 1}, "logprobs"),
        ({"length_penalty": 2.0}, "length_penalty"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_fields_that_cannot_work_are_400s_naming_them(extra: dict[str, Any], param: str) -> None:
    assert param_of("completion", COMPLETION | extra) == param


def test_defaults_of_refused_fields_pass() -> None:
    parsed = parse_request(
        "completion", COMPLETION | {"priority": 0, "cache_salt": "", "best_of": 1}
    )
    assert parsed.sampling.max_tokens == 16


def test_prompt_logprobs_echo_and_max_tokens_zero() -> None:
    parsed = parse_request(
        "completion", COMPLETION | {"echo": True, "logprobs": 3, "max_tokens": 0}
    )
    assert parsed.score_only and parsed.sampling.max_tokens == 1
    assert parsed.sampling.prompt_logprobs == 3 and not parsed.prompt_logprobs_listed
    parsed = parse_request("chat", CHAT | {"prompt_logprobs": 0})
    assert parsed.sampling.prompt_logprobs == 0 and parsed.prompt_logprobs_listed


def test_chat_template_options() -> None:
    carry_on = CHAT | {
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "Hel"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    chat = parse_request("chat", carry_on).chat
    assert (chat.add_generation_prompt, chat.continue_final_message) == (False, True)
    assert chat.template_kwargs == {"enable_thinking": False}
    assert param_of("chat", carry_on | {"add_generation_prompt": True}) == "continue_final_message"
    assert (
        param_of("chat", CHAT | {"continue_final_message": True, "add_generation_prompt": False})
        == "continue_final_message"
    )
    assert (
        param_of("chat", CHAT | {"chat_template_kwargs": {"messages": []}})
        == "chat_template_kwargs"
    )
    assert (
        param_of("completion", COMPLETION | {"chat_template_kwargs": {}}) == "chat_template_kwargs"
    )


def test_responses_bodies_become_chat_bodies() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = chat_body(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
            "max_output_tokens": 9,
            "tools": [tool],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            "store": False,
        }
    )
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in body["messages"][2]["tool_calls"]] == ["c1", "c2"]
    assert body["max_completion_tokens"] == 9
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ApiError) as info:  # a named tool is structured output already
        parse_request("chat", body)
    assert info.value.param == "response_format"
    parsed = parse_request("chat", {k: v for k, v in body.items() if k != "tool_choice"})
    assert parsed.sampling.guided_kind == "json_schema"  # text.format
    assert json.loads(parsed.sampling.guided_spec) == {"type": "object"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"type": "image"}]}, "input"),
        ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text"),
        ({"temperature_x": 1}, "temperature_x"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"service_tier": "priority"}, "service_tier"),
    ],
)
def test_responses_refusals_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat_body({"model": "m", "input": "hi"} | extra)
    assert info.value.param == param
