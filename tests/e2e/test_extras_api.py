"""Tool calling, the Responses API and prompt logprobs through `splitserve up` with the
real default model (SmolLM2, whose template has no tools: the gateway writes the Hermes
convention in), with the OpenAI SDK: forced calls validate, streamed calls equal
non-streamed ones, a conversation carrying a tool result continues, /v1/responses answers,
prompt logprobs equal the engine's own logprobs for the same tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
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
    # fp32: beam search is checked against transformers' own (fp32) logits
    flags = ["--dtype", "float32"]
    yield from start_mesh(real_model_dir, tmp_path_factory.mktemp("home"), flags)


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


def engine_generation(model_dir: Path, prompt: list[int], max_tokens: int):
    """(token ids, their logprobs) of a greedy run on the engine alone, in chunks of 4."""
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        num_kv_blocks=64,
        max_num_batched_tokens=4,
        max_num_seqs=2,
    )  # the mesh's dtype; fmt: skip
    engine = LLMEngine(config)
    engine.add_request(
        "r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
    )
    outputs = [o for _ in range(100) if engine.has_unfinished_requests() for o in engine.step()]
    return [t for o in outputs for t in o.new_token_ids], [
        lp.logprob for o in outputs for lp in o.new_logprobs
    ]


def test_prompt_logprobs_equal_the_engines(mesh: Mesh, model: str, real_model_dir: Path) -> None:
    """Tokens the engine generated greedily, scored as a prompt through the mesh: each gets
    the logprob the engine gave it as it generated it."""
    prompt = (
        Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
        .encode("The capital of France is")
        .ids
    )
    generated, logprobs = engine_generation(real_model_dir, prompt, 6)
    scored = mesh.client.completions.create(
        model=model, prompt=prompt + generated, max_tokens=0, echo=True, logprobs=2,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    choice = scored.choices[0]
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    echoed = choice.logprobs
    assert len(echoed.tokens) == len(prompt) + len(generated) and echoed.token_logprobs[0] is None
    assert echoed.token_logprobs[len(prompt) :] == pytest.approx(logprobs, abs=1e-4)
    listed = choice.model_extra["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(echoed.tokens)
    for i, token_id in enumerate(prompt + generated):
        if i:
            entry = listed[i][str(token_id)]
            assert entry["logprob"] == echoed.token_logprobs[i] and len(listed[i]) <= 3
            assert entry["rank"] == 1 or i < len(prompt)  # the generated ones were greedy
    assert all(len(top) <= 2 for top in echoed.top_logprobs[1:])


def reference_beams(model_dir: Path, prompt: list[int], width: int, steps: int) -> list[list[int]]:
    """Textbook beam search on transformers' logits (no end-of-sequence within `steps`):
    keep the `width` best continuations by summed logprob, recomputing every prefix."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(steps):
        grown = []
        for tokens, total in beams:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            top = torch.log_softmax(logits.float(), dim=-1).topk(2 * width)
            pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
            grown += [(tokens + [t], total + lp) for t, lp in pairs]
        beams = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
    return [tokens for tokens, _ in beams]


def test_beam_search_is_deterministic_and_equals_a_reference(
    mesh: Mesh, model: str, real_model_dir: Path
) -> None:
    prompt = (
        Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
        .encode("The capital of France is")
        .ids
    )
    kwargs = dict(model=model, prompt=prompt, max_tokens=3, n=3,
                  extra_body={"use_beam_search": True, "length_penalty": 1.0})  # fmt: skip
    first = mesh.client.completions.create(**kwargs)
    again = mesh.client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and len(set(texts)) == 3
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    expected = [tokenizer.decode(b) for b in reference_beams(real_model_dir, prompt, 3, 3)]
    assert texts == expected
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage.completion_tokens == 9
