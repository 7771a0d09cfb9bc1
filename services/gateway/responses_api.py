"""POST /v1/responses: OpenAI's Responses API over the same generation as chat completions.

The body becomes a chat body (`responses_input.py`) and runs as one choice. The reply is a
`response` object whose `output` holds a `message` item (output_text) and one
`function_call` item per tool call. Streamed, the events are OpenAI's, each with its
`sequence_number`: response.created, response.in_progress, then per item
response.output_item.added, (response.content_part.added, response.output_text.delta …,
response.output_text.done, response.content_part.done) or
(response.function_call_arguments.delta …, response.function_call_arguments.done),
response.output_item.done, and last response.completed (status `incomplete` with
incomplete_details when max_output_tokens cut it). A failure mid-stream is a
`response.failed` event.
"""

from __future__ import annotations

import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.gateway.choices import merged_events
from services.gateway.completions import own_model, prepare, tool_stream
from services.gateway.errors import ApiError, api_error
from services.gateway.limits import tenant_of
from services.gateway.refusals import GenerationFailed
from services.gateway.request_body import RequestBody, json_body
from services.gateway.responses_input import CHAT_TO_RESPONSES, chat_body
from services.gateway.sse import SSEWriter
from services.gateway.token_events import Finish
from services.gateway.tool_parsers import plain
from services.gateway.tool_stream import ToolCallStream


async def create_response(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    chat = RequestBody("chat", chat_body(body), tenant_of(request))
    try:
        chat.parsed()
    except ApiError as exc:
        exc.param = CHAT_TO_RESPONSES.get(exc.param or "", exc.param)
        raise
    client = await own_model(request, chat)
    parsed, choices = prepare(client, chat)
    shape = ResponseShape(
        f"resp_{choices.request_id}",
        client.config.served_model_name,
        body,
        tool_stream(client, parsed) or ToolCallStream(plain),
    )
    first = await choices.submit(client, 0)
    try:
        if not parsed.stream:
            text, finish = "", None
            try:
                async with aclosing(merged_events(client, choices, first)) as events:
                    async for _, event in events:
                        if isinstance(event, Finish):
                            finish = event
                        else:
                            text += event.text
            except GenerationFailed as exc:
                raise api_error(exc) from None
            if finish is None:
                raise ApiError(500, "the token stream ended without a finish")
            shape.advance(text, finish)  # parsed whole: no partial call is ever kept
            return web.json_response(shape.response())
        sse = SSEWriter(request)
        await sse.start()
        try:
            for event in shape.opening():
                await sse.send(event, event["type"])
            async with aclosing(merged_events(client, choices, first)) as events:
                async for _, event in events:
                    finish = event if isinstance(event, Finish) else None
                    for out in shape.advance("" if finish else event.text, finish):
                        await sse.send(out, out["type"])
        except GenerationFailed as exc:
            failed = shape.event("response.failed", response=shape.response("failed", str(exc)))
            await sse.send(failed, failed["type"])
        return await sse.done()
    finally:
        await client.abandon(first)


@dataclass(slots=True)
class ResponseShape:
    """One response's state: its items so far, and the events that built them."""

    id: str
    model: str
    body: dict[str, Any]  # the request as sent, echoed in the response object
    tools: ToolCallStream
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0
    text: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # call index → item
    message_id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")
    message_open: bool = False
    finish: Finish | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def advance(self, text: str, finish: Finish | None) -> list[dict[str, Any]]:
        """The stream events for more text, and for the finish when it is given."""
        content, entries = self.tools.feed(text, finish is not None)
        out = self._text(content) + [e for entry in entries for e in self._call(entry)]
        if finish is not None:
            self.finish = finish
            out += self._close_items()
            out.append(self.event("response.completed", response=self.response()))
        return out

    def _text(self, content: str) -> list[dict[str, Any]]:
        if not content:
            return []
        out = []
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        if not self.message_open:
            self.message_open = True
            out.append(
                self.event(
                    "response.output_item.added",
                    output_index=0,
                    item=self._message("in_progress", ""),
                )
            )
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    part=_part(""),
                )
            )
        self.text += content
        out.append(self.event("response.output_text.delta", **where, delta=content, logprobs=[]))
        return out

    def _call(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        index = entry["index"]
        fragment = entry["function"]["arguments"]
        output_index = index + self.message_open
        if "id" in entry:
            item = {
                "id": f"fc_{secrets.token_hex(12)}",
                "type": "function_call",
                "call_id": entry["id"],
                "name": entry["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self.calls[index] = item
            added = self.event("response.output_item.added", output_index=output_index, item=item)
            out = [added | {"item": dict(item)}]
        else:
            out = []
        item = self.calls[index]
        item["arguments"] += fragment
        if fragment:
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=output_index,
                    delta=fragment,
                )
            )
        return out

    def _close_items(self) -> list[dict[str, Any]]:
        out = []
        if self.message_open:
            where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            out.append(
                self.event("response.output_text.done", **where, text=self.text, logprobs=[])
            )
            out.append(self.event("response.content_part.done", **where, part=_part(self.text)))
            out.append(
                self.event(
                    "response.output_item.done",
                    output_index=0,
                    item=self._message("completed", self.text),
                )
            )
        for index, item in self.calls.items():
            item["status"] = "completed"
            output_index = index + self.message_open
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=output_index,
                    arguments=item["arguments"],
                )
            )
            out.append(
                self.event("response.output_item.done", output_index=output_index, item=dict(item))
            )
        return out

    def _message(self, status: str, text: str) -> dict[str, Any]:
        content = [_part(text)] if status == "completed" else []
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(self, status: str = "", error: str = "") -> dict[str, Any]:
        """The response object; status "" means: from the finish."""
        cut = self.finish is not None and self.finish.reason == "length"
        status = status or ("incomplete" if cut else "completed")
        output = []
        if status in ("completed", "incomplete"):
            if self.message_open:
                output.append(self._message("completed", self.text))
            output += [dict(item) for item in self.calls.values()]
        usage = None
        if self.finish is not None:
            used = self.finish.usage
            usage = {
                "input_tokens": used.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": used.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": used.prompt_tokens + used.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": self.body.get("instructions"),
            "max_output_tokens": self.body.get("max_output_tokens"),
            "metadata": self.body.get("metadata") or {},
            "output": output,
            "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
            "temperature": self.body.get("temperature", 1.0),
            "top_p": self.body.get("top_p", 1.0),
            "tool_choice": self.body.get("tool_choice", "auto"),
            "tools": self.body.get("tools", []),
            "text": self.body.get("text", {"format": {"type": "text"}}),
            "truncation": "disabled",
            "store": False,
            "usage": usage,
        }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
