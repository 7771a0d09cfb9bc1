"""Structured-output fields of a request → SamplingParams.guided_kind / guided_spec.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`: exactly one of them) and its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (aliases); at most one
field per request. The gateway
does not import xgrammar (it would bring torch), so it checks what it can here and names
the problem in a 400: the JSON Schema's structure keyword by keyword, regexes with Python's
`re` parser (refusing the constructs xgrammar's regex dialect lacks), choices and grammars
by shape. The worker compiles the spec with xgrammar.
"""

from __future__ import annotations

import json
import re
from re import _constants as re_constants
from re import _parser as re_parser
from typing import Any

from services.gateway.errors import invalid

GUIDED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
)  # fmt: skip
# structured_outputs' keys → the guided_* field each is an alias of.
_STRUCTURED_OUTPUTS = {
    "json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
    "grammar": "guided_grammar",
}  # fmt: skip
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def guided_fields(body: dict[str, Any]) -> tuple[str, str]:
    """(guided_kind, guided_spec) for SamplingParams; ("", "") when the request asks none."""
    given = [name for name in GUIDED_FIELDS if name in body]
    if len(given) > 1:
        raise invalid(f"use only one of {', '.join(given)}", given[1])
    if not given:
        return "", ""
    name = given[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _guided(name, value, name)


def _structured_outputs(value: Any) -> tuple[str, str]:
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid(f"{where} must be an object", where)
    value = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(value) - {*_STRUCTURED_OUTPUTS, "json_object"})
    if unknown:
        raise invalid(
            f"{where}: unsupported key(s): {', '.join(unknown)} (supported: json, regex, "
            "choice, grammar, json_object)",
            where,
        )
    if len(value) != 1:
        raise invalid(
            f"{where} must set exactly one of json, regex, choice, grammar, json_object", where
        )
    key, spec = next(iter(value.items()))
    if key == "json_object":
        if spec is not True:
            raise invalid(f"{where}.json_object must be true", where)
        return "json_object", ""
    return _guided(_STRUCTURED_OUTPUTS[key], spec, f"{where}.{key}")


def _guided(name: str, value: Any, where: str) -> tuple[str, str]:
    """A guided_* field's value (or the structured_outputs key it is an alias of)."""
    if name == "guided_json":
        schema = json.loads(value) if isinstance(value, str) and _is_json(value) else value
        check_schema(schema, where)
        return "json_schema", json.dumps(schema)
    if name == "guided_regex":
        return "regex", _regex(value, where)
    if name == "guided_choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise invalid(f"{where} must be a non-empty list of strings", where)
        return "choice", json.dumps(value)
    if not (isinstance(value, str) and "root" in value and "::=" in value):
        raise invalid(f"{where} must be an EBNF grammar with a rule `root ::= ...`", where)
    return "grammar", value


def _response_format(value: Any) -> tuple[str, str]:
    where = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return "", ""
    if kind == "json_object":
        return "json_object", ""
    if kind != "json_schema":
        raise invalid(f"{where}.type must be text, json_object or json_schema", where)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise invalid(f"{where}.json_schema must be an object with a schema", where)
    check_schema(spec["schema"], f"{where}.json_schema.schema")
    return "json_schema", json.dumps(spec["schema"])


def check_schema(schema: Any, where: str) -> None:
    """400 naming the first keyword of `schema` (at path `where`) that is malformed."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be a JSON Schema object", where)
    kind = schema.get("type")
    for name in kind if isinstance(kind, list) else [kind] if kind is not None else []:
        if name not in _TYPES:
            raise invalid(f"{where}.type: {name!r} is not a JSON Schema type", where)
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise invalid(f"{where}.{key} must map names to schemas", where)
            for name, sub in schema[key].items():
                check_schema(sub, f"{where}.{key}.{name}")
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not (isinstance(schema[key], list) and schema[key]):
                raise invalid(f"{where}.{key} must be a non-empty list of schemas", where)
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}.{key}[{i}]")
    for key in _SCHEMA_ONE:
        if key in schema:
            check_schema(schema[key], f"{where}.{key}")
    required = schema.get("required", [])
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise invalid(f"{where}.required must be a list of property names", where)
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        raise invalid(f"{where}.enum must be a non-empty list", where)
    for key in _COUNTS:
        value = schema.get(key, 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise invalid(f"{where}.{key} must be a non-negative integer", where)
    for key in _BOUNDS:
        value = schema.get(key, 0)
        if not (isinstance(value, int | float) and not isinstance(value, bool)):
            raise invalid(f"{where}.{key} must be a number", where)
    if "pattern" in schema:
        _regex(schema["pattern"], f"{where}.pattern")
    if "$ref" in schema and not str(schema["$ref"]).startswith("#"):
        raise invalid(f"{where}.$ref: only local references (#/...) are supported", where)


def _regex(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"{where} must be a non-empty regular expression", where)
    try:
        parsed = re_parser.parse(value)
    except re.error as exc:
        raise invalid(f"{where} is not a valid regular expression: {exc}", where) from None
    if parsed.state.groupdict:
        raise invalid(f"{where}: named groups (?P<name>...) are not supported", where)
    unsupported = _unsupported_construct(parsed)
    if parsed.state.flags & _FLAGS:
        unsupported = "inline flags ((?i), (?s:...))"
    if unsupported:
        raise invalid(f"{where}: {unsupported} are not supported in guided regexes", where)
    return value


# Python `re` syntax that xgrammar's regex converter refuses (checked against 0.2.x): the
# grammar is a finite automaton, so nothing that looks around, back or inside the match.
_UNSUPPORTED = {
    re_constants.ASSERT: "lookarounds (?=...), (?<=...)",
    re_constants.ASSERT_NOT: "negative lookarounds (?!...), (?<!...)",
    re_constants.GROUPREF: "backreferences (\\1, (?P=name))",
    re_constants.GROUPREF_EXISTS: "conditional groups (?(1)...)",
    re_constants.ATOMIC_GROUP: "atomic groups (?>...)",
    re_constants.POSSESSIVE_REPEAT: "possessive repeats (a++, a*+)",
}
_UNSUPPORTED_AT = {re_constants.AT_BOUNDARY, re_constants.AT_NON_BOUNDARY}
_FLAGS = re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE | re.ASCII


def _unsupported_construct(pattern: Any) -> str:
    """The first construct of a parsed pattern that xgrammar refuses, or ""."""
    for op, arg in pattern:
        if op in _UNSUPPORTED:
            return _UNSUPPORTED[op]
        if op == re_constants.AT and arg in _UNSUPPORTED_AT:
            return "word boundaries (\\b, \\B)"
        if op == re_constants.SUBPATTERN:
            _group, add_flags, del_flags, inner = arg
            if add_flags or del_flags:
                return "inline flags ((?i), (?s:...))"
            found = _unsupported_construct(inner)
        elif op in (re_constants.MAX_REPEAT, re_constants.MIN_REPEAT):
            found = _unsupported_construct(arg[2])
        elif op == re_constants.BRANCH:
            found = next((f for f in map(_unsupported_construct, arg[1]) if f), "")
        else:
            found = ""
        if found:
            return found
    return ""


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
