"""Tool-call parsers on recorded model outputs, whole and streamed piece by piece, and the
request side: tools / tool_choice parsing, the enforcing schemas, the template inputs."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from services.gateway.errors import ApiError
from services.gateway.json_scan import NotJson, value_end
from services.gateway.openai_schema import parse_request
from services.gateway.tool_parsers import hermes, json_array, llama3_json, mistral, named
from services.gateway.tool_prompt import parser_for, template_inputs
from services.gateway.tool_stream import ToolCallStream
from services.gateway.tools import parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

# Outputs as models wrote them (Qwen2.5-Coder / Hermes 3, Llama 3.1, Mistral v0.3).
QWEN_TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA_CALL = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo \\"N\\""}}'
MISTRAL_CALLS = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
    '{"name": "get_time", "arguments": {}}]'
)


def whole(stream: ToolCallStream, text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = stream.calls(text)
    return content, [(c.name, c.arguments) for c in calls]


def streamed(stream: ToolCallStream, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` `step` characters at a time; assemble the deltas as a client does."""
    content = ""
    calls: dict[int, list[str]] = {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)] + [""]
    for i, piece in enumerate(pieces):
        new, entries = stream.feed(piece, final=i == len(pieces) - 1)
        content += new
        for entry in entries:
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["id"].startswith("call_")
                calls[entry["index"]] = [entry["function"]["name"], ""]
            calls[entry["index"]][1] += entry["function"]["arguments"]
    return content, [(name, args) for name, args in calls.values()]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize(
    ("scanner", "text", "content", "calls"),
    [
        (
            hermes,
            QWEN_TWO_CALLS,
            "Let me check.\n",
            [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")],
        ),
        (  # Qwen2.5-Coder-0.5B-Instruct's greedy reply, recorded: no <tool_call> tags
            hermes,
            '{"name": "get_weather", "arguments": {"city": "Paris"}}',
            "",
            [("get_weather", '{"city": "Paris"}')],
        ),
        (llama3_json, LLAMA_CALL, "", [("get_weather", '{"city": "Oslo \\"N\\""}')]),
        (
            mistral,
            MISTRAL_CALLS,
            "",
            [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")],
        ),
        (
            json_array,
            '[{"name": "get_time", "parameters": {"tz": "UTC"}}]',
            "",
            [("get_time", '{"tz": "UTC"}')],
        ),
        (named("get_weather"), '{"city": "Lima"}', "", [("get_weather", '{"city": "Lima"}')]),
    ],
)
def test_recorded_calls_parse_the_same_whole_or_streamed(
    scanner: Any, text: str, content: str, calls: list[tuple[str, str]], step: int
) -> None:
    assert whole(ToolCallStream(scanner), text) == (content, calls)
    assert streamed(ToolCallStream(scanner), text, step) == (content, calls)
    for _name, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize(
    ("scanner", "text"),
    [
        (hermes, "No tools needed: the answer is 4."),
        (hermes, 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut
        (hermes, '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),  # no name
        (hermes, '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'),
        (hermes, "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),  # not JSON
        (hermes, "a < b and <tool_call"),  # a tag that never completes
        (llama3_json, "The weather in Paris is mild."),
        (llama3_json, '{"answer": 42}'),  # JSON, but not a call
        (llama3_json, '{"name": "get_weather", "parameters": {"city": }}'),
        (mistral, "[TOOL_CALLS] get_weather Paris"),
        (mistral, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}'),
        (json_array, '[{"name": "get_time", "parameters": {"tz": "U'),  # max_tokens cut it
        (named("get_weather"), '{"city": "Li'),
    ],
)
def test_malformed_or_plain_output_is_content(scanner: Any, text: str) -> None:
    assert whole(ToolCallStream(scanner), text) == (text, [])
    content, _ = streamed(ToolCallStream(scanner), text, 4)
    assert content.endswith(text[-4:])  # the stream ends with all the text shown as content


def test_plain_text_streams_before_the_output_ends() -> None:
    stream = ToolCallStream(hermes)
    assert stream.feed("Hello <tool") == ("Hello ", [])  # the tag's start is held back
    assert stream.feed("s> are fine") == ("<tools> are fine", [])
    assert stream.feed("", final=True) == ("", []) and not stream.called


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    stream = ToolCallStream(hermes, single=True)
    assert whole(stream, QWEN_TWO_CALLS)[1] == [("get_weather", '{"city": "Paris", "unit": "c"}')]


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields


def test_required_and_named_enforce_schemas_the_arguments_satisfy() -> None:
    required = parse_request("chat", chat_body(tools=[WEATHER, TIME], tool_choice="required"))
    assert required.sampling.guided_kind == "json_schema"
    schema = json.loads(required.sampling.guided_spec)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "x", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = parse_tools(chat_body(tools=[TIME], tool_choice="required", parallel_tool_calls=False))
    assert json.loads(single.guided()[1])["maxItems"] == 1
    choice = {"type": "function", "function": {"name": "get_weather"}}
    forced = parse_request("chat", chat_body(tools=[WEATHER], tool_choice=choice))
    assert json.loads(forced.sampling.guided_spec) == WEATHER["function"]["parameters"]
    auto = parse_request("chat", chat_body(tools=[WEATHER]))
    assert auto.tools is not None and auto.tools.choice == "auto"
    assert auto.sampling.guided_kind == ""


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
            "type": "json_object"}}, "response_format"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_them(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request("chat", chat_body(**fields))
    assert (info.value.status, info.value.param) == (400, param)


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_tool_messages_reach_a_template_with_tools_as_objects() -> None:
    parsed = parse_request("chat", chat_body(messages=CONVERSATION, tools=[WEATHER]))
    assert parsed.messages is not None
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"
    messages, tools = template_inputs(template, parsed.messages, parsed.tools)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tools == [WEATHER | {"function": WEATHER["function"]}]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}


def test_a_template_without_tools_gets_the_hermes_convention() -> None:
    parsed = parse_request("chat", chat_body(messages=CONVERSATION, tools=[WEATHER]))
    assert parsed.messages is not None
    messages, tools = template_inputs("{{ messages }}", parsed.messages, parsed.tools)
    assert tools is None and messages[0]["role"] == "system"
    assert '"name": "get_weather"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    call = messages[2]["content"]
    assert call.startswith("<tool_call>") and '"arguments": {"city": "Paris"}' in call
    assert messages[3] == {
        "role": "user",
        "content": "<tool_response>\n18 C, sunny\n</tool_response>",
    }
    assert parser_for("{{ messages }}", "auto") == "hermes"
    assert parser_for("{% if tools %}[TOOL_CALLS]{% endif %}", "auto") == "mistral"
    assert parser_for("{% if tools %}<|python_tag|>{% endif %}", "auto") == "llama3_json"
    assert parser_for("{{ messages }}", "mistral") == "mistral"


@pytest.mark.parametrize(
    ("message", "where"),
    [
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0]"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
         "messages[0].tool_calls"),
        ({"role": "wizard", "content": "x"}, "messages[0]"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0]"),
    ],
)  # fmt: skip
def test_bad_messages_are_400s(message: dict[str, Any], where: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request("chat", chat_body(messages=[message]))
    assert info.value.param == where


VALID_JSON = [
    '{"a": [1, {"b": null}], "c": "x}\\"]", "d": -1.5e3, "e": true, "f": {}}',
    '[[], [{}], "", 0, false]',
    '{"emoji": "😀", "nested": {"deep": [[[1]]]}}',
]


@pytest.mark.parametrize("text", VALID_JSON)
def test_every_prefix_of_valid_json_is_open_and_the_whole_ends(text: str) -> None:
    assert value_end(text, 0) == len(text)
    for cut in range(1, len(text)):
        assert value_end(text[:cut], 0) in (None, cut)  # never NotJson


@pytest.mark.parametrize("text", ['{"a" 1', "[1 2", '{"a": 1,}', '{"a": Par', '{"a": [1}'])
def test_bad_json_is_refused_while_it_is_still_open(text: str) -> None:
    with pytest.raises(NotJson):
        value_end(text, 0)
