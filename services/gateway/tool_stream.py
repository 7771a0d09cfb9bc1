"""One choice's output split into content and tool calls, as OpenAI deltas or whole.

`ToolCallStream.feed` takes each piece of detokenized text and returns the new content and
the new `tool_calls` delta entries: a call's first entry carries its id, type and name (and
any arguments so far), later ones argument fragments only. `calls` is the non-streamed
view of the same text. Ids are `call_` plus 24 hex digits, one per call index.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from services.gateway.tool_parsers import Scanner


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_dict(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(slots=True)
class ToolCallStream:
    scanner: Scanner
    single: bool = False  # parallel_tool_calls=false: only the first call counts
    text: str = ""
    content_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)  # per call index
    ids: list[str] = field(default_factory=list)
    calling: bool = False  # the latest scan found calls

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(new content, new tool_calls delta entries) once `piece` is added."""
        self.text += piece
        scan = self.scanner(self.text, final)
        self.calling = bool(scan.calls)
        content = scan.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(scan.content))
        entries: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls[:1] if self.single else scan.calls):
            if call.name is None:
                break
            if index == len(self.ids):
                self.ids.append(f"call_{secrets.token_hex(12)}")
                self.arguments_sent.append(len(call.arguments))
                function = {"name": call.name, "arguments": call.arguments}
                opening = {"index": index, "id": self.ids[index], "type": "function"}
                entries.append(opening | {"function": function})
                continue
            fragment = call.arguments[self.arguments_sent[index] :]
            if fragment:
                self.arguments_sent[index] = len(call.arguments)
                entries.append({"index": index, "function": {"arguments": fragment}})
        return content, entries

    @property
    def called(self) -> bool:
        """Has the stream sent a tool call that is still one? (Output that turns out not
        to be a call, once parts of it went out, ends as content.)"""
        return bool(self.ids) and self.calling

    def calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        scan = self.scanner(text, True)
        calls = scan.calls[:1] if self.single else scan.calls
        found = [
            ToolCall(f"call_{secrets.token_hex(12)}", c.name, c.arguments)
            for c in calls
            if c.name is not None
        ]
        return scan.content, found
