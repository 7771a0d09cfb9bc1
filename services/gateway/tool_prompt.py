"""Tools and tool messages into the chat template, and which parser reads the reply.

A template that mentions `tools` renders them itself, as transformers does: it gets the
OpenAI tool definitions, and assistant tool calls with their arguments as objects (vLLM
does the same). A template that does not (SmolLM2's, for one) gets the Hermes convention
written into the conversation: the definitions in the system message, past calls as
`<tool_call>` text, tool results as user turns in `<tool_response>`; its replies are then
read with the hermes parser. `--tool-call-parser auto` picks the parser from the template's
own tags.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.tools import ToolRequest

_HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\nFor each function call, return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_PARSER_TAGS = (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))


def renders_tools(template: str) -> bool:
    return "tools" in template


def parser_for(template: str, configured: str) -> str:
    """The configured parser, or for "auto" the one the template's tags name (hermes when
    none does, or when the template cannot render tools and gets the Hermes convention)."""
    if configured != "auto":
        return configured
    if renders_tools(template):
        for tag, parser in _PARSER_TAGS:
            if tag in template:
                return parser
    return "hermes"


def template_inputs(
    template: str, messages: list[dict[str, Any]], tools: ToolRequest | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as `template` should see them."""
    definitions = [f.as_tool() for f in tools.functions] if tools and tools.active else None
    if renders_tools(template):
        return [_with_argument_objects(m) for m in messages], definitions
    converted = [_as_hermes_text(m) for m in messages]
    if definitions:
        listing = "\n".join(json.dumps(d, ensure_ascii=False) for d in definitions)
        system = _HERMES_SYSTEM.format(tools=listing)
        if converted[0]["role"] == "system":
            first = converted[0]
            converted[0] = first | {"content": f"{first['content']}\n\n{system}"}
        else:
            converted.insert(0, {"role": "system", "content": system})
    return converted, None


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Past calls' arguments as objects (messages.py checked that they are JSON)."""
    if "tool_calls" not in message:
        return message
    calls = [
        call
        | {"function": call["function"] | {"arguments": json.loads(call["function"]["arguments"])}}
        for call in message["tool_calls"]
    ]
    return message | {"tool_calls": calls}


def _as_hermes_text(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = [
        json.dumps(
            {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
            ensure_ascii=False,
        )
        for c in message.get("tool_calls", [])
    ]
    text = "".join(f"\n<tool_call>\n{call}\n</tool_call>" for call in calls)
    return {"role": message["role"], "content": (content + text).lstrip("\n")}
