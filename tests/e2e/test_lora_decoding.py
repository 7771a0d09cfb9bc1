"""Structured output and tool calling with a LoRA adapter, through the whole mesh
(`splitserve up --lora-modules`, real model, a random PEFT adapter of it, OpenAI SDK): the
greedy output under the adapter is valid (the JSON schema; the tool's name and parameters)
and the streamed reply is the non-streamed one, token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from loadtest.engine_bench.lora import write_random_adapter
from shared.engine import native
from shared.engine.model_config import ModelConfig
from tests.e2e.test_decoding_api import SCHEMAS
from tests.e2e.test_mesh import Mesh, start_mesh
from tests.e2e.test_tools_gateway_api import ASK, WEATHER, assemble

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(native.load() is None, reason="C++ kernels not built"),
]
ADAPTER = "tuned"


@pytest.fixture(scope="module")
def mesh(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("lora-decoding")
    config = ModelConfig.from_dir(real_model_dir)
    adapter = write_random_adapter(root / ADAPTER, config, 8, seed=3, std=0.05)
    flags = ["--dtype", "float32", "--max-model-len", "2048"]
    flags += ["--lora-modules", f"{ADAPTER}={adapter}"]
    home = root / "home"
    home.mkdir()
    yield from start_mesh(real_model_dir, home, flags)


def chat(mesh: Mesh, messages: list[dict], **kwargs):
    return mesh.client.chat.completions.create(
        model=ADAPTER, messages=messages, temperature=0, **kwargs
    )


def test_json_schema_output_under_an_adapter_is_valid_streamed_or_not(mesh: Mesh) -> None:
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    for schema in SCHEMAS[:2]:
        response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        reply = chat(mesh, ask, max_tokens=120, response_format=response_format)
        assert reply.model == ADAPTER and reply.choices[0].finish_reason == "stop"
        text = reply.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        stream = chat(mesh, ask, max_tokens=120, response_format=response_format, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_tool_call_under_an_adapter_is_valid_streamed_or_not(mesh: Mesh, choice) -> None:
    reply = chat(mesh, ASK, max_tokens=80, tools=[WEATHER], tool_choice=choice)
    assert reply.choices[0].finish_reason in ("tool_calls", "stop")
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = chat(mesh, ASK, max_tokens=80, tools=[WEATHER], tool_choice=choice, stream=True)
    content, calls, _ = assemble(list(stream))
    assert content == (reply.choices[0].message.content or "")
    assert calls == [("get_weather", call.function.arguments)]
