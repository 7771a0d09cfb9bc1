"""A /v1/responses request body → the equivalent chat completions body.

`input` is a string (one user message) or a list of items: messages ({role, content} with
content a string or input_text/output_text parts), `function_call` items (become an
assistant message's tool_calls; consecutive ones share one message) and
`function_call_output` items (tool messages). `instructions` becomes a leading system
message. Tools are the Responses API's flat function tools; `text.format` maps to
response_format. Responses are not stored: `store: true`, `previous_response_id`,
`background`, `include` and `reasoning` are 400s saying so. Errors name the Responses field.
"""

from __future__ import annotations

from typing import Any

from services.gateway.errors import invalid

_PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "seed")
_ACCEPTED = {
    *_PASSED, "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
    "store", "metadata", "truncation", "service_tier",
}  # fmt: skip
_REFUSED = {
    "previous_response_id": "responses are not stored",
    "conversation": "conversations are not stored",
    "background": "background responses are not supported",
    "include": "no extra output items are produced",
    "reasoning": "this server has no reasoning options",
    "prompt": "stored prompts are not supported",
    "top_logprobs": "this route returns no logprobs (use /v1/chat/completions)",
}
_TEXT_PARTS = ("input_text", "output_text", "text")
# chat field → the Responses field a chat-side error is about
CHAT_TO_RESPONSES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def chat_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    for name, why in _REFUSED.items():
        if name in body and body[name] not in (False, [], 0):
            raise invalid(f"{name} is not supported: {why}", name)
        body.pop(name, None)
    unsupported = sorted(set(body) - _ACCEPTED)
    if unsupported:
        raise invalid(f"unsupported field(s): {', '.join(unsupported)}", unsupported[0])
    if body.get("store", False):
        raise invalid(
            "store is not supported: responses are not stored (send store: false)", "store"
        )
    if body.get("truncation", "disabled") != "disabled":
        raise invalid("truncation: only 'disabled' is supported", "truncation")
    if body.get("service_tier", "auto") not in ("auto", "default"):
        raise invalid("service_tier: only 'auto' and 'default' are served", "service_tier")
    if not isinstance(body.get("metadata", {}), dict):
        raise invalid("metadata must be an object", "metadata")
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = _messages(body)
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if "text" in body:
        chat["response_format"] = _format(body["text"])
    return chat


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list) or not items:
        raise invalid("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item, where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _string(item, "output", where),
                }
            )
        else:
            raise invalid(
                f"{where}: items must be messages, function_call or function_call_output", "input"
            )
    return messages


def _content(item: dict[str, Any], where: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(f"{where}.content must be a string or a list of text parts", "input")


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{where}.{name} must be a string", "input")
    return value


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid("tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type") == "function"):
            raise invalid(f"tools[{i}]: only function tools are supported", "tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: Any) -> dict[str, Any]:
    spec = text.get("format", {"type": "text"}) if isinstance(text, dict) else None
    if not isinstance(spec, dict) or set(text) - {"format"}:
        raise invalid("text must be {format: {...}}", "text")
    if spec.get("type") == "json_schema":
        schema = {k: spec[k] for k in ("name", "schema", "strict") if k in spec}
        return {"type": "json_schema", "json_schema": schema}
    return spec
