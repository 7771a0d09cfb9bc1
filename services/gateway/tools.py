"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request → a ToolRequest.

tool_choice `none` (the default without tools): no tools reach the template and nothing
is parsed. `auto` (the default with tools): the model decides; its output goes through the
model's tool-call parser (`tool_parsers.py`). `required` and a named function are enforced
by structured output, as vLLM does: `required` constrains the output to a JSON array of
{"name", "parameters"} objects valid against the functions' schemas (at most one with
parallel_tool_calls=false), a named function to that function's arguments, so the
arguments always validate. A function without `parameters` takes any object.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import invalid
from services.gateway.structured import check_schema
from services.gateway.tool_parsers import Scanner, json_array, named, scanner_for
from services.gateway.tool_stream import ToolCallStream

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_NAME = re.compile(r"^[a-zA-Z0-9_.\-]{1,64}$")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema for the arguments

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool definition, as chat templates read it."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": function | {"parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    functions: tuple[Function, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    function: str  # the function tool_choice names ("" unless choice == "named")
    parallel: bool

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def guided(self) -> tuple[str, str]:
        """(guided_kind, guided_spec) that enforces required / named; ("", "") otherwise."""
        if self.choice == "named":
            chosen = next(f for f in self.functions if f.name == self.function)
            return "json_schema", json.dumps(chosen.parameters)
        if self.choice != "required":
            return "", ""
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [f.name]}, "parameters": f.parameters},
                "required": ["name", "parameters"],
            }
            for f in self.functions
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return "json_schema", json.dumps(schema)

    def stream(self, parser: str) -> ToolCallStream:
        """A fresh parser of one choice's output."""
        scanner: Scanner
        if self.choice == "named":
            scanner = named(self.function)
        elif self.choice == "required":
            scanner = json_array
        else:
            scanner = scanner_for(parser)
        return ToolCallStream(scanner, single=not self.parallel)


def parse_tools(body: dict[str, Any]) -> ToolRequest:
    """The request's tools; 400 naming the field when they are malformed."""
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise invalid("tools must be a list of function tools", "tools")
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise invalid("tools: function names must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be true or false", "parallel_tool_calls")
    choice, function = _choice(body.get("tool_choice", "auto" if functions else "none"))
    if choice != "none" and not functions:
        raise invalid(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "named" and function not in names:
        raise invalid(f"tool_choice names {function!r}, which is not in tools", "tool_choice")
    return ToolRequest(functions, choice, function, parallel)


def _function(tool: Any, where: str) -> Function:
    if not (isinstance(tool, dict) and tool.get("type") == "function"):
        raise invalid(f"{where} must be {{'type': 'function', 'function': {{...}}}}", "tools")
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        raise invalid(f"{where}: unsupported field(s): {', '.join(extra)}", "tools")
    spec = tool.get("function")
    if not isinstance(spec, dict):
        raise invalid(f"{where}.function must be an object", "tools")
    return function_of(spec, f"{where}.function")


def function_of(spec: dict[str, Any], where: str) -> Function:
    """A function definition {name, description?, parameters?, strict?}."""
    extra = sorted(set(spec) - {"name", "description", "parameters", "strict"})
    if extra:
        raise invalid(f"{where}: unsupported field(s): {', '.join(extra)}", "tools")
    name = spec.get("name")
    if not (isinstance(name, str) and _NAME.match(name)):
        raise invalid(f"{where}.name must be 1-64 letters, digits, _ . or -", "tools")
    description = spec.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.description must be a string", "tools")
    if not isinstance(spec.get("strict", False), bool | None):
        raise invalid(f"{where}.strict must be true or false", "tools")
    parameters = spec.get("parameters") or _ANY_OBJECT
    check_schema(parameters, f"{where}.parameters")
    return Function(name, description, parameters)


def _choice(value: Any) -> tuple[str, str]:
    if value in ("none", "auto", "required"):
        return value, ""
    function = value.get("function") if isinstance(value, dict) else None
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    ):
        return "named", function["name"]
    raise invalid(
        "tool_choice must be none, auto, required or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )
