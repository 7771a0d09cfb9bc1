"""Tool calling and the Responses API through `splitserve up` with the real default model
(SmolLM2, whose template has no tools: the gateway writes the Hermes convention in), with
the OpenAI SDK: forced calls validate, streamed calls equal non-streamed ones, a
conversation carrying a tool result continues, /v1/responses answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.e2e.test_mesh import Mesh, start_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": PARAMETERS,
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time now"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def mesh(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from start_mesh(real_model_dir, tmp_path_factory.mktemp("home"), [])


@pytest.fixture(scope="module")
def model(mesh: Mesh) -> str:
    return mesh.client.models.list().data[0].id


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = ""
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.id:
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(name, arguments) for name, arguments in calls.values()], finish


def test_forced_calls_validate_and_stream_the_same(mesh: Mesh, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        kwargs = dict(
            model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
            parallel_tool_calls=False, max_tokens=200, temperature=0.8, seed=3,
        )  # fmt: skip
        reply = mesh.client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        for name, arguments in calls:
            if name == "get_weather":
                jsonschema.validate(json.loads(arguments), PARAMETERS)
            else:
                assert name == "get_time" and isinstance(json.loads(arguments), dict)
        if tool_choice == named:
            assert [name for name, _ in calls] == ["get_weather"]
        stream = mesh.client.chat.completions.create(**kwargs, stream=True)
        assert streamed_calls(stream) == (calls, "tool_calls")  # same seed, same tokens


def test_a_conversation_with_a_tool_result_continues(mesh: Mesh, model: str) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, result]
    reply = mesh.client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30,
        temperature=0,
    )  # fmt: skip
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 60  # the call and its result are in the prompt


def test_responses_api(mesh: Mesh, model: str) -> None:
    response = mesh.client.responses.create(
        model=model, input="Name a colour.", instructions="Answer in one word.",
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert response.output_text and response.status in ("completed", "incomplete")
    events = list(
        mesh.client.responses.create(
            model=model, input="Name a colour.", instructions="Answer in one word.",
            max_output_tokens=8, temperature=0, stream=True,
        )
    )  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed" and deltas == response.output_text
