"""Tool calling, the Responses API, vLLM's extra fields and endpoints through the real
gateway and the OpenAI SDK, over a fake mesh that plays recorded model outputs (the fake
of tests/integration/test_gateway.py): what the client sees, and what reaches the mesh.
Also the reply shapes of prompt logprobs, built from a delta as the mesh delivers it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from services.gateway.prompt_scores import PromptScoring
from services.gateway.prompting import ModelText
from services.gateway.responses import ResponseBuilder
from services.gateway.token_events import Delta, Finish, Usage
from shared.nats_server import NatsServer
from shared.protocol import PromptTokenLogprob, TokenLogprob
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.integration.conftest import nats_server  # noqa: F401  (fixture)
from tests.integration.gateway_harness import (
    MODEL,
    Harness,
    Script,
    gateway_config,
    http,
    run_gateway,
    start_gateway,
)

pytestmark = pytest.mark.e2e
MAX_MODEL_LEN = 2048  # room for tool definitions in the prompt

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_REPLY = (
    'I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "c"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def gw(nats_server: NatsServer, real_model_dir: Path) -> Iterator[Harness]:  # noqa: F811
    config = dataclasses.replace(
        gateway_config(nats_server, real_model_dir, "gw-tools"), max_model_len=MAX_MODEL_LEN
    )
    yield from run_gateway(nats_server, config, real_model_dir)


@pytest.fixture(scope="module")
def mistral_gw(
    gw: Harness,
    nats_server: NatsServer,  # noqa: F811
    real_model_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Harness]:
    """A second gateway on the same fake mesh: `[TOOL_CALLS]` a special token of its
    tokenizer, --tool-call-parser mistral."""
    model_dir = tmp_path_factory.mktemp("mistral-tokenizer")
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(["[TOOL_CALLS]"])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    shutil.copy(real_model_dir / "tokenizer_config.json", model_dir)
    config = dataclasses.replace(
        gateway_config(nats_server, model_dir, "gw-mistral"),
        max_model_len=MAX_MODEL_LEN,
        tool_call_parser="mistral",
    )
    runner = gw.run(start_gateway(config))
    yield Harness(f"http://127.0.0.1:{config.port}", gw.mesh, gw.loop, ModelText.load(model_dir))
    gw.run(runner.cleanup())


def play(gw: Harness, text: str, finish: str = "stop", chunk: int = 1) -> list[int]:
    """Make the fake mesh answer every request with `text`, `chunk` tokens a chunk."""
    ids = gw.text.tokenizer.encode(text, add_special_tokens=False).ids
    script: Script = [(ids[i : i + chunk], None, "") for i in range(0, len(ids), chunk)]
    eos = gw.text.tokenizer.token_to_id("<|im_end|>")
    script.append(([eos], "stop", "") if finish == "stop" else ([], "length", ""))
    gw.mesh.script, gw.mesh.hang, gw.mesh.refuse, gw.mesh.refuse_ending = script, False, False, ""
    return ids


def prompt_text(gw: Harness) -> str:
    return gw.text.tokenizer.decode(gw.mesh.submitted[-1].prompt_token_ids, False)


def assemble(chunks: list[Any]) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed chat reply."""
    content, calls, finish = "", {}, ""
    for c in chunks:
        delta = c.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id:
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content, [tuple(v) for v in calls.values()], finish


def test_auto_tool_call_from_a_template_without_tools(gw: Harness) -> None:
    play(gw, HERMES_REPLY)
    client = gw.client()
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    prompt = prompt_text(gw)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the Hermes convention
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up.\n"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
    assert assemble(list(stream)) == (
        "I will look it up.\n",
        [("get_weather", call.function.arguments)],
        "tool_calls",
    )


def test_required_and_named_are_enforced_and_stream_the_same(gw: Harness) -> None:
    client = gw.client()
    play(gw, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required"
    )
    sent = gw.mesh.submitted[-1].sampling
    assert sent.guided_kind == "json_schema"  # the worker constrains the output to it
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}],
                        json.loads(sent.guided_spec))  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert reply.choices[0].finish_reason == "tool_calls"
    play(gw, '{"city": "Lima", "unit": "f"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=named
    )
    assert (
        json.loads(gw.mesh.submitted[-1].sampling.guided_spec) == WEATHER["function"]["parameters"]
    )
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=named, stream=True
    )
    content, calls, finish = assemble(list(stream))
    assert (content, calls, finish) == ("", [("get_weather", call.function.arguments)], finish)


def test_mistral_calls_are_read_behind_their_special_token(mistral_gw: Harness) -> None:
    play(mistral_gw, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    marker = mistral_gw.text.tokenizer.token_to_id("[TOOL_CALLS]")
    assert mistral_gw.mesh.script[0][0] == [marker]  # played as the one special token
    client = mistral_gw.client()
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Rome"}')
    assert reply.choices[0].message.content is None
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
    assert assemble(list(stream)) == ("", [("get_weather", '{"city": "Rome"}')], "tool_calls")
    reply = client.chat.completions.create(model=MODEL, messages=ASK)  # no tools: skipped
    assert reply.choices[0].message.content.startswith('[{"name"')


def test_a_conversation_with_tool_results_continues(gw: Harness) -> None:
    play(gw, "It is 18 C and sunny in Paris.")
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_7", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "18 C, sunny"},
    ]  # fmt: skip
    reply = gw.client().chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert reply.choices[0].message.content == "It is 18 C and sunny in Paris."
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    prompt = prompt_text(gw)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


def test_malformed_tool_output_is_plain_content(gw: Harness) -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    play(gw, broken)
    reply = gw.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    assert reply.choices[0].message.content == broken and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    stream = gw.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], stream=True
    )
    # What went out as a call before the JSON broke stays a prefix of the text; the whole
    # text then follows as content, and the finish is plain.
    content, calls, finish = assemble(list(stream))
    assert (content, finish) == (broken, "stop")
    assert all(name == "get_weather" and arguments in broken for name, arguments in calls)


def test_vllm_fields(gw: Harness) -> None:
    client = gw.client()
    play(gw, "Hello. Bye")
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, stop=["."],
        extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False,
                    "structured_outputs": {"regex": "[A-Za-z. ]+"}, "repetition_penalty": 1.1,
                    "min_tokens": 1},
    )  # fmt: skip
    assert reply.choices[0].message.content == "Hello."
    sent = gw.mesh.submitted[-1].sampling
    assert (sent.guided_kind, sent.guided_spec) == ("regex", "[A-Za-z. ]+")
    assert (sent.repetition_penalty, sent.min_tokens) == (1.1, 1)
    ids = play(gw, "Hi")
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"skip_special_tokens": False}
    )
    assert reply.choices[0].message.content == "Hi<|im_end|>"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == len(ids) + 1  # + the end-of-turn token
    messages = [*ASK, {"role": "assistant", "content": "The weather is"}]
    client.chat.completions.create(
        model=MODEL, messages=messages,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert prompt_text(gw).endswith("<|im_start|>assistant\nThe weather is")
    for field, value in (
        ("priority", "high"),
        ("cache_salt", "x"),
        ("best_of", 2),
        ("length_penalty", 0.5),  # without use_beam_search
        ("structured_outputs", {"whitespace": "x"}),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, extra_body={field: value})
        assert info.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=ASK, stop=["x"], extra_body={"use_beam_search": True}
        )
    assert info.value.body["param"] == "stop" and "beam search" in info.value.message


def test_tokenize_detokenize_version_ping(gw: Harness) -> None:
    text = "漢字と絵文字 😀👍🏽 done"
    status, tokens = http(gw, "/tokenize", json.dumps({"model": MODEL, "prompt": text}).encode())
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN and tokens["token_strs"] is None
    status, back = http(gw, "/detokenize", json.dumps({"tokens": tokens["tokens"]}).encode())
    assert (status, back) == (200, {"prompt": text})
    status, chat = http(
        gw, "/tokenize", json.dumps({"messages": ASK, "return_token_strs": True}).encode()
    )
    assert status == 200 and chat["tokens"] == gw.text.chat_prompt_ids(ASK)
    assert "".join(chat["token_strs"]).startswith("<|im_start|>system")
    status, error = http(gw, "/detokenize", json.dumps({"tokens": [10**9]}).encode())
    assert status == 400 and error["error"]["param"] == "tokens"
    status, found = http(gw, "/version")
    assert status == 200 and found["version"]
    status, _ = http(gw, "/tokenize", json.dumps({"prompt": "x"}).encode(), key="wrong")
    assert status == 401


def test_responses_api(gw: Harness) -> None:
    client = gw.client()
    play(gw, "Paris is sunny today.")
    response = client.responses.create(
        model=MODEL, input="Weather in Paris?", instructions="Be brief.", max_output_tokens=50
    )
    assert response.status == "completed" and response.output_text == "Paris is sunny today."
    assert response.usage.output_tokens > 0
    prompt = prompt_text(gw)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt and "Weather in Paris?" in prompt
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"}],
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Paris is sunny today." == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    play(gw, HERMES_REPLY)
    tool = {"type": "function", **WEATHER["function"]}
    response = client.responses.create(model=MODEL, input="Weather?", tools=[tool])
    call = next(item for item in response.output if item.type == "function_call")
    assert (call.name, json.loads(call.arguments)) == (
        "get_weather",
        {"city": "Paris", "unit": "c"},
    )
    play(gw, "18 C.")
    follow_up = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]  # fmt: skip
    assert (
        client.responses.create(model=MODEL, input=follow_up, tools=[tool]).output_text == "18 C."
    )
    assert "<tool_response>\n18 C\n</tool_response>" in prompt_text(gw)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"


def test_streamed_responses_with_a_tool_call(gw: Harness) -> None:
    play(gw, HERMES_REPLY)
    tool = {"type": "function", **WEATHER["function"]}
    client = gw.client()
    whole = client.responses.create(model=MODEL, input="Weather?", tools=[tool])
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[tool],
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    fragments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    call = next(i for i in whole.output if i.type == "function_call")
    assert fragments == done.arguments == call.arguments
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output] == [
        "message", "function_call"]  # fmt: skip
    assert final.output_text == whole.output_text == "I will look it up.\n"


def test_prompt_logprobs_shapes(gw: Harness) -> None:
    """The reply shapes of prompt logprobs, from a delta as the mesh delivers it."""
    entries = [PromptTokenLogprob(12, -1.5, 3, [(7, -0.5), (9, -1.0)]),
               PromptTokenLogprob(13, -0.25, 1, [(13, -0.25), (9, -2.0)])]  # fmt: skip
    delta = Delta("!", [5], [TokenLogprob(5, -0.1, [(5, -0.1), (6, -3.0)])], entries)
    finish = Finish("length", Usage(3, 1))
    token = gw.text.token_text
    scoring = PromptScoring(11, listed=True, echoed=True, score_only=False)
    echo = ResponseBuilder("completion", "r", MODEL, gw.text, prefix="abc", scoring=scoring)
    choice = echo.full([delta], finish)["choices"][0]
    assert choice["logprobs"]["tokens"] == [token(11), token(12), token(13), token(5)]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5, -0.25, -0.1]
    assert choice["logprobs"]["top_logprobs"][0] is None
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1]["12"] == {"logprob": -1.5, "rank": 3,
                                                   "decoded_token": token(12)}  # fmt: skip
    assert choice["prompt_logprobs"][1]["7"]["rank"] == 1 and len(choice["prompt_logprobs"]) == 3
    only = PromptScoring(11, listed=True, echoed=False, score_only=True)
    scored = ResponseBuilder("completion", "r", MODEL, gw.text, prefix="abc", scoring=only)
    body = scored.full([delta], finish)
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 0
    chat = ResponseBuilder("chat", "r", MODEL, gw.text, scoring=only).chunk(delta, None, True)
    assert len(chat["prompt_logprobs"]) == 3 and "prompt_logprobs" not in chat["choices"][0]
