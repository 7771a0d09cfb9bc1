"""Tool calls out of model text, whole or while it streams, for each format models write.

A scanner reads the text generated so far and says what of it is plain content and which
calls it has begun; it is called again on the longer text as tokens arrive (`final` once
generation has ended), so one function serves streaming and non-streaming alike.
- hermes (Qwen, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
  content is the text before the first tag.
- llama3_json: the whole output is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several separated by `;`.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; content before the tag.
- the forced forms (tool_choice required / named, `tools.py`): a JSON array of
  `{"name", "parameters"}` objects, or the named function's arguments alone.
Text after the last call is dropped, as vLLM does. Output that is not a valid call (bad
JSON, no name, cut off by max_tokens) is returned whole as content, never an error; a
stream that has already sent part of such a call sends the rest of the text as content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.json_scan import NotJson, object_fields, skip_whitespace

PARSERS = ("hermes", "llama3_json", "mistral")
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARKER = "[TOOL_CALLS]"
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True, slots=True)
class PartialCall:
    name: str | None  # None until the model has written the whole name
    arguments: str  # the arguments' JSON text so far, exactly as written
    complete: bool  # the call's JSON is whole


@dataclass(frozen=True, slots=True)
class Scan:
    content: str  # plain text; a prefix of the content of any longer text's scan
    calls: tuple[PartialCall, ...]


Scanner = Callable[[str, bool], Scan]


def scanner_for(parser: str) -> Scanner:
    return {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}[parser]


def plain(text: str, final: bool) -> Scan:
    """No tools: all of it is content."""
    return Scan(text, ())


def named(function: str) -> Scanner:
    """The output is `function`'s arguments (tool_choice names a function)."""

    def scan(text: str, final: bool) -> Scan:
        if final and not _is_object(text):
            return Scan(text, ())
        return Scan("", (PartialCall(function, text, final),))

    return scan


def json_array(text: str, final: bool) -> Scan:
    """A JSON array of {"name", "parameters"} (tool_choice required)."""
    return _safely(text, final, lambda: Scan("", _call_array(text, skip_whitespace(text, 0))))


def hermes(text: str, final: bool) -> Scan:
    first = text.find(_HERMES_START)
    if first < 0 and text[skip_whitespace(text, 0) :].startswith("{"):
        # Small models of this template (Qwen2.5-Coder-0.5B) often leave the tags out and
        # answer with the bare {"name", "arguments"} object: read it as llama3_json does.
        return llama3_json(text, final)
    if first < 0:
        return Scan(text if final else _hold_back(text, _HERMES_START), ())

    def scan() -> Scan:
        calls: list[PartialCall] = []
        i = first
        while True:
            i = skip_whitespace(text, i + len(_HERMES_START))
            if i == len(text):
                break
            call, end = _call_object(text, i)
            calls.append(call)
            if end is None:
                break
            j = skip_whitespace(text, end)
            if text.startswith(_HERMES_END, j):
                j = skip_whitespace(text, j + len(_HERMES_END))
            elif not _HERMES_END.startswith(text[j:]):
                raise NotJson(f"expected {_HERMES_END}")
            if not text.startswith(_HERMES_START, j):
                break
            i = j
        return Scan(text[:first], tuple(calls))

    return _safely(text, final, scan)


def llama3_json(text: str, final: bool) -> Scan:
    i = skip_whitespace(text, 0)
    if text.startswith(_PYTHON_TAG, i):
        i = skip_whitespace(text, i + len(_PYTHON_TAG))
    if i == len(text) or (not final and _PYTHON_TAG.startswith(text[i:])):
        return Scan(text if final else "", ())
    if text[i] != "{":
        return Scan(text, ())

    def scan() -> Scan:
        calls: list[PartialCall] = []
        j = i
        while True:
            call, end = _call_object(text, j)
            calls.append(call)
            if end is None:
                break
            j = skip_whitespace(text, end)
            if not text.startswith(";", j):
                break
            j = skip_whitespace(text, j + 1)
            if j == len(text):
                break
        return Scan("", tuple(calls))

    return _safely(text, final, scan)


def mistral(text: str, final: bool) -> Scan:
    first = text.find(MISTRAL_MARKER)
    if first < 0:
        return Scan(text if final else _hold_back(text, MISTRAL_MARKER), ())
    start = skip_whitespace(text, first + len(MISTRAL_MARKER))
    return _safely(text, final, lambda: Scan(text[:first], _call_array(text, start)))


def _safely(text: str, final: bool, scan: Callable[[], Scan]) -> Scan:
    """`scan()`, or all of `text` as content when it is not (or, when final, not yet) calls."""
    try:
        result = scan()
    except NotJson:
        return Scan(text, ())
    if final and not (result.calls and all(c.complete for c in result.calls)):
        return Scan(text, ())
    return result


def _call_array(text: str, i: int) -> tuple[PartialCall, ...]:
    if i == len(text):
        return ()
    if text[i] != "[":
        raise NotJson("expected a list of calls")
    calls: list[PartialCall] = []
    j = skip_whitespace(text, i + 1)
    while j < len(text):
        call, end = _call_object(text, j)
        calls.append(call)
        if end is None:
            break
        j = skip_whitespace(text, end)
        if text.startswith("]", j):
            break
        if j < len(text) and text[j] != ",":
            raise NotJson("expected ',' or ']'")
        j = skip_whitespace(text, j + 1)
    return tuple(calls)


def _call_object(text: str, i: int) -> tuple[PartialCall, int | None]:
    """One `{"name": ..., "arguments"/"parameters": {...}}` from text[i]; its end or None."""
    fields, end = object_fields(text, i)
    name_span = fields.get("name")
    name = None
    if name_span is not None and name_span.end is not None:
        name = json.loads(name_span.raw(text))
        if not isinstance(name, str):
            raise NotJson("a tool call's name must be a string")
    arguments = next((fields[k] for k in _ARGUMENT_KEYS if k in fields), None)
    raw = arguments.raw(text) if arguments is not None else ""
    if end is not None and (name is None or arguments is None or not _is_object(raw)):
        raise NotJson("a tool call needs a name and an arguments object")
    return PartialCall(name, raw, end is not None), end


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _hold_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text
