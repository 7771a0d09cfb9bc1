"""Chat messages and the chat-template options of a request, checked field by field.

A message is {role, content, name?}; an assistant message may carry `tool_calls` (content
then optional) and a `tool` message its `tool_call_id`. Content is a string or a list of
text parts. ChatOptions: vLLM's `add_generation_prompt` (default true),
`continue_final_message` (the reply goes on from the last, assistant, message; needs
add_generation_prompt false) and `chat_template_kwargs` (extra template variables, e.g.
Qwen3's `enable_thinking`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import invalid

CHAT_OPTION_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
_MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}
_ROLES = ("system", "developer", "user", "assistant", "tool")
# Names the template sets itself: chat_template_kwargs may not replace them.
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt"}

Message = dict[str, Any]  # what the chat template reads: role, content, tool_calls, ...


@dataclass(frozen=True, slots=True)
class ChatOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def chat_options(body: dict[str, Any], messages: list[Message]) -> ChatOptions:
    add = body.get("add_generation_prompt", True)
    carry_on = body.get("continue_final_message", False)
    kwargs = body.get("chat_template_kwargs", {})
    for name, value in (("add_generation_prompt", add), ("continue_final_message", carry_on)):
        if not isinstance(value, bool):
            raise invalid(f"{name} must be true or false", name)
    if carry_on and add:
        raise invalid(
            "continue_final_message needs add_generation_prompt=false", "continue_final_message"
        )
    if carry_on and messages[-1]["role"] != "assistant":
        raise invalid(
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = sorted(_RESERVED & set(kwargs))
    if reserved:
        raise invalid(
            f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
        )
    return ChatOptions(add, carry_on, dict(kwargs))


def parse_messages(body: dict[str, Any]) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, where: str) -> Message:
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise invalid(f"{where} must be an object with a role in {', '.join(_ROLES)}", where)
    message = {k: v for k, v in message.items() if v is not None}
    extra = sorted(set(message) - _MESSAGE_FIELDS)
    if extra:
        raise invalid(f"{where}: unsupported field(s): {', '.join(extra)}", where)
    role = message["role"]
    out: Message = {"role": role}
    if "name" in message:
        if not isinstance(message["name"], str):
            raise invalid(f"{where}.name must be a string", where)
        out["name"] = message["name"]
    if "tool_calls" in message:
        if role != "assistant":
            raise invalid(f"{where}: only assistant messages carry tool_calls", where)
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if "tool_call_id" in message:
        if role != "tool" or not isinstance(message["tool_call_id"], str):
            raise invalid(f"{where}.tool_call_id must be a string, on a tool message", where)
        out["tool_call_id"] = message["tool_call_id"]
    if "content" in message or "tool_calls" not in out:
        out["content"] = _content(message.get("content"), where)
    else:
        out["content"] = ""
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise invalid(f"{where} must be a list", where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not (isinstance(name, str) and isinstance(arguments, str)):
            raise invalid(f"{where}[{i}] must have function.name and function.arguments", where)
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            raise invalid(f"{where}[{i}].function.arguments must be JSON text", where) from None
        call_id = call.get("id", f"call_{i}")
        if not isinstance(call_id, str):
            raise invalid(f"{where}[{i}].id must be a string", where)
        function = {"name": name, "arguments": arguments}
        out.append({"id": call_id, "type": "function", "function": function})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(f"{where}.content must be a string or a list of text parts", where)
