"""Structured output on the tiny random model: whatever the weights say, the grammar decides.

The tiny model gets a byte-level tokenizer (token i = byte i), so every output decodes to
text; random weights make the content arbitrary, which is what a grammar must survive.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.gateway.errors import ApiError
from services.gateway.openai_schema import parse_request
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import InvalidRequest
from shared.engine.sampling_params import InvalidParameter, SamplingParams
from shared.engine.sequence import FinishReason
from tests.conftest import write_tiny_model

EOS = 2  # the tiny model's eos id, byte 0x02 in this tokenizer

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["x", "y"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
     "required": ["name"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "q": {"type": "integer"}, "r": {"type": "boolean"}}, "required": ["q", "r"]}},
     "required": ["p"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "maxLength": 3}, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["n"]},
    {"type": "object", "properties": {"v": {"type": "null"}}, "required": ["v"]},
    {"type": "object", "properties": {"id": {"type": "integer"}, "note": {"type": "string",
     "maxLength": 4}}, "required": ["id"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "at": {"type": "array",
     "items": {"type": "number"}, "minItems": 2, "maxItems": 2}}, "required": ["kind", "at"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "boolean"}},
     "required": ["k"]}, "maxItems": 3},
    {"type": "object", "properties": {"deep": {"type": "object", "properties": {"deeper": {
        "type": "object", "properties": {"leaf": {"enum": ["a", "b"]}},
        "required": ["leaf"]}}, "required": ["deeper"]}}, "required": ["deep"]},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]{2,4}$"}},
     "required": ["s"]},
    {"type": "object", "properties": {"either": {"anyOf": [{"type": "integer"},
     {"type": "boolean"}]}}, "required": ["either"]},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array",
     "items": {"type": "integer"}, "maxItems": 2}, "maxItems": 2}}, "required": ["m"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string",
     "maxLength": 3}, "c": {"type": "boolean"}}, "required": ["a", "b", "c"],
     "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 1}, "currency": {
        "enum": ["EUR", "USD"]}}, "required": ["price", "currency"]},
]  # fmt: skip


def _byte_chars() -> list[str]:
    """GPT-2's byte → printable character map, indexed by byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(rest)}
    return [chars[b] for b in range(256)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-bytes"))
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(_byte_chars())}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=512))


def guided(kind: str, spec: str = "", **overrides) -> SamplingParams:
    settings = {"temperature": 1.0, "max_tokens": 300} | overrides
    return SamplingParams(guided_kind=kind, guided_spec=spec, **settings)


def generate(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, str]:
    """Run the requests together; each must stop on its own (eos), never on length."""
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, params in requests.items():
        engine.add_request(rid, [5, 6, 7], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                assert out.finish_reason == FinishReason.STOP, (out.request_id, tokens)
    assert all(t[-1] == EOS for t in tokens.values())
    return {rid: bytes(t[:-1]).decode("utf-8") for rid, t in tokens.items()}


def test_twenty_schemas_always_give_valid_json(engine: LLMEngine) -> None:
    requests = {
        f"s{i}-{seed}": guided("json_schema", json.dumps(schema), seed=seed)
        for i, schema in enumerate(SCHEMAS)
        for seed in (0, 1)
    }
    for rid, text in generate(engine, requests).items():
        schema = SCHEMAS[int(rid[1:].split("-")[0])]
        # strict=False: xgrammar 0.2.9's rule for strings with minLength/maxLength lets raw
        # control characters through (its plain string rule excludes them).
        jsonschema.validate(json.loads(text, strict=False), schema)


def test_json_object_regex_choice_and_grammar(engine: LLMEngine) -> None:
    choices = ["yes", "no", "maybe later"]
    ebnf = 'root ::= "(" digit+ ("+" digit+)* ")"\ndigit ::= [0-9]'
    # Free JSON nests without end on random weights; a bias towards closing brackets ends it
    # sooner, and the grammar still decides where one may go.
    close = {ord("}"): 6.0, ord("]"): 6.0, ord('"'): 3.0}
    requests = {}
    for seed in range(4):
        requests[f"obj{seed}"] = guided("json_object", seed=seed, logit_bias=close)
        requests[f"re{seed}"] = guided("regex", r"[A-Z][a-z]{1,5}-\d{2,3}", seed=seed)
        requests[f"ch{seed}"] = guided("choice", json.dumps(choices), seed=seed)
        requests[f"gr{seed}"] = guided("grammar", ebnf, seed=seed, logit_bias={ord(")"): 4.0})
    out = generate(engine, requests)
    for seed in range(4):
        assert isinstance(json.loads(out[f"obj{seed}"]), dict)
        assert re.fullmatch(r"[A-Z][a-z]{1,5}-\d{2,3}", out[f"re{seed}"])
        assert out[f"ch{seed}"] in choices
        assert re.fullmatch(r"\(\d+(\+\d+)*\)", out[f"gr{seed}"])


def test_free_rows_in_the_same_batch_are_untouched(engine: LLMEngine) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    solo: list[int] = []
    engine.add_request("solo", [5, 6, 7], free)
    while engine.has_unfinished_requests():
        solo += [t for out in engine.step() for t in out.new_token_ids]
    mixed: list[int] = []
    engine.add_request("mixed", [5, 6, 7], free)
    engine.add_request("guided", [5, 6, 7], guided("regex", "[0-9]{30}", seed=3))
    while engine.has_unfinished_requests():
        mixed += [t for o in engine.step() if o.request_id == "mixed" for t in o.new_token_ids]
    assert mixed == solo


def test_decode_side_rebuilds_the_matcher_from_tokens_so_far(engine: LLMEngine) -> None:
    """A prefill engine samples the first token; a decode engine (here: a reservation with
    delivered tokens, as after migration) continues inside the same grammar, exactly."""
    params = guided("json_schema", json.dumps(SCHEMAS[7]), seed=11)
    whole: list[int] = []
    engine.add_request("whole", [5, 6, 7], params)
    while engine.has_unfinished_requests():
        whole += [t for out in engine.step() for t in out.new_token_ids]
    cut = 9
    engine.add_request("resumed", [5, 6, 7], params, output_token_ids=whole[:cut])
    resumed = list(whole[:cut])
    while engine.has_unfinished_requests():
        resumed += [t for out in engine.step() for t in out.new_token_ids]
    assert resumed == whole
    engine.reserve("moved", [5, 6, 7], params, output_token_ids=whole[: cut - 1])
    first = engine.start_decode("moved", whole[cut - 1])
    moved = [*whole[: cut - 1], *first.new_token_ids]
    while engine.has_unfinished_requests():
        moved += [t for out in engine.step() for t in out.new_token_ids]
    assert moved == whole


@pytest.mark.parametrize(
    ("kind", "spec", "problem"),
    [
        ("json_schema", '{"type": "object", "properties": {"a": {"type": 5}}}', "json_schema"),
        ("json_schema", "{not json", "json_schema"),
        ("regex", "[a-z", "regex"),
        ("grammar", "root ::= undefined_rule", "grammar"),
    ],
)
def test_specs_xgrammar_cannot_compile_are_refused(
    engine: LLMEngine, kind: str, spec: str, problem: str
) -> None:
    with pytest.raises(InvalidRequest, match=f"invalid {problem}"):
        engine.add_request("bad", [5, 6, 7], guided(kind, spec))
    assert "bad" not in engine.requests


def test_guided_fields_are_checked() -> None:
    with pytest.raises(InvalidParameter, match="guided_kind"):
        SamplingParams(guided_kind="xml", guided_spec="<a/>")
    with pytest.raises(InvalidParameter, match="guided_spec"):
        SamplingParams(guided_kind="regex")
    with pytest.raises(InvalidParameter, match="guided_spec"):
        SamplingParams(guided_spec="[0-9]")


def test_gateway_maps_every_structured_field() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    schema = SCHEMAS[7]
    cases = [
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        ({"response_format": {"type": "text"}}, ("", "")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": schema}}}, ("json_schema", json.dumps(schema))),
        ({"guided_json": json.dumps(schema)}, ("json_schema", json.dumps(schema))),
        ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
        ({"guided_choice": ["a", "b"]}, ("choice", '["a", "b"]')),
        ({"guided_grammar": 'root ::= "x"'}, ("grammar", 'root ::= "x"')),
    ]  # fmt: skip
    for extra, expected in cases:
        sampling = parse_request("chat", chat | extra).sampling
        assert (sampling.guided_kind, sampling.guided_spec) == expected


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strnig"}, "schema.type: 'strnig' is not a JSON Schema type"),
        ({"properties": {"a": {"type": ["integer", "decimal"]}}}, "properties.a.type"),
        ({"properties": []}, "schema.properties must map names to schemas"),
        ({"items": {"anyOf": []}}, "schema.items.anyOf must be a non-empty list"),
        ({"required": "a"}, "schema.required must be a list"),
        ({"maxLength": -1}, "schema.maxLength must be a non-negative integer"),
        ({"properties": {"s": {"pattern": "(unclosed"}}}, "properties.s.pattern is not a valid"),
        ({"$ref": "http://example.com/s.json"}, "only local references"),
        ("not a schema", "schema must be a JSON Schema object"),
    ],
)
def test_gateway_names_the_problem_in_a_bad_schema(schema: object, message: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body["response_format"] = response_format
    with pytest.raises(ApiError) as info:
        parse_request("chat", body)
    assert info.value.status == 400 and message in str(info.value)
