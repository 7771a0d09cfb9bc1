"""A scanner for JSON text that may still be arriving: where values end, field by field.

Tool calls stream as JSON the model is still writing. `object_fields` reads the top-level
fields of an object and returns each value's span as raw text, the last one open (end None)
while the text runs out inside it; `value_end` finds where one value ends. Nothing is
re-serialized: a call's arguments are exactly the characters the model wrote, so streamed
fragments add up to the non-streamed arguments. Syntax that can never become JSON raises
`NotJson`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\r\n"
_SCALAR_END = ",}] \t\r\n"


class NotJson(ValueError):
    """The text cannot be the start of the JSON expected here."""


@dataclass(frozen=True, slots=True)
class Span:
    start: int
    end: int | None  # None: the value is still open where the text ends

    def raw(self, text: str) -> str:
        return text[self.start : self.end]


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The index just after the JSON value starting at text[i]; None if the text ends first."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        return _container_end(text, i)
    j = i
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    if j == len(text):
        if not _could_be_scalar(text[i:]):
            raise NotJson(f"not the start of a JSON value: {text[i:]!r}")
        return None  # a number or literal may go on
    try:
        json.loads(text[i:j])
    except json.JSONDecodeError:
        raise NotJson(f"not a JSON value: {text[i:j]!r}") from None
    return j


def object_fields(text: str, i: int) -> tuple[dict[str, Span], int | None]:
    """The fields of the object whose `{` is text[i], and the index after its `}` (None while
    it is open). A key still being written is left out."""
    if text[i] != "{":
        raise NotJson("expected an object")
    fields: dict[str, Span] = {}
    j = skip_whitespace(text, i + 1)
    if j < len(text) and text[j] == "}":
        return fields, j + 1
    while j < len(text):
        if text[j] != '"':
            raise NotJson("expected a key")
        key_end = _string_end(text, j)
        if key_end is None:
            return fields, None
        key = json.loads(text[j:key_end])
        j = skip_whitespace(text, key_end)
        if j == len(text):
            return fields, None
        if text[j] != ":":
            raise NotJson("expected ':'")
        j = skip_whitespace(text, j + 1)
        if j == len(text):
            return fields, None
        end = value_end(text, j)
        fields[key] = Span(j, end)
        if end is None:
            return fields, None
        j = skip_whitespace(text, end)
        if j == len(text):
            return fields, None
        if text[j] == "}":
            return fields, j + 1
        if text[j] != ",":
            raise NotJson("expected ',' or '}'")
        j = skip_whitespace(text, j + 1)
    return fields, None


def _could_be_scalar(start: str) -> bool:
    """Can `start` grow into a number, true, false or null?"""
    if any(literal.startswith(start) for literal in ("true", "false", "null")):
        return True
    return all(c in "-+.eE0123456789" for c in start) and start[0] in "-0123456789"


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _container_end(text: str, i: int) -> int | None:
    """Like value_end for the object or array at text[i], checking its syntax as far as the
    text goes, so a stream learns of bad JSON at its first bad character."""
    # per open container: [its closing bracket, what comes next]
    stack = [["}", "key_or_end"] if text[i] == "{" else ["]", "value_or_end"]]
    j = i + 1
    while True:
        j = skip_whitespace(text, j)
        if j == len(text):
            return None
        c, top = text[j], stack[-1]
        closing, expect = top
        if c == closing and expect in ("comma_or_end", "key_or_end", "value_or_end"):
            stack.pop()
            j += 1
            if not stack:
                return j
        elif expect in ("value", "value_or_end"):
            top[1] = "comma_or_end"
            if c in "{[":
                stack.append(["}", "key_or_end"] if c == "{" else ["]", "value_or_end"])
                j += 1
            else:
                end = value_end(text, j)
                if end is None:
                    return None
                j = end
        elif expect in ("key", "key_or_end") and c == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            top[1], j = "colon", end
        elif expect == "colon" and c == ":":
            top[1], j = "value", j + 1
        elif expect == "comma_or_end" and c == ",":
            top[1], j = ("key" if closing == "}" else "value"), j + 1
        else:
            raise NotJson(f"unexpected {c!r} in JSON")
