"""A fake OpenAI-compatible streaming server with scripted timings, for testing the harness
(and for trying it without a model). Loopback only.

Every request streams `max_tokens` tokens: the first chunk after `ttft_s`, then one chunk
of `tokens_per_chunk` tokens every `itl_s`, then a usage chunk and `[DONE]`. A text prompt
can ask for a failure: `fail:429` (HTTP 429), `fail:stream` (an error event mid-stream),
`fail:hang` (never answers).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(slots=True, frozen=True)
class Script:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_chunk: int = 1
    model: str = "fake-model"


@dataclass(slots=True)
class FakeServer:
    script: Script = field(default_factory=Script)
    received: list[float] = field(default_factory=list)  # perf_counter at each POST
    port: int = 0
    _runner: web.AppRunner | None = None
    _closing: asyncio.Event = field(default_factory=asyncio.Event)  # ends `fail:hang`

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self._closing.set()
        if self._runner:
            await self._runner.cleanup()

    def gap(self) -> float:
        """Seconds before a stream's next chunk: the script's (a test may vary it)."""
        return self.script.itl_s

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.script.model}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.received.append(time.perf_counter())
        body = await request.json()
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "fail:429":
            return web.json_response({"error": {"message": "busy"}}, status=429)
        if prompt == "fail:hang":
            await self._closing.wait()
            return web.Response(status=503)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        s = self.script
        total = int(body["max_tokens"])
        await asyncio.sleep(s.ttft_s)
        sent = 0
        while sent < total:
            n = min(s.tokens_per_chunk, total - sent)
            await _send(reply, _chunk(chat, "x" * n))
            sent += n
            if prompt == "fail:stream":
                await _send(reply, {"error": {"message": "worker lost"}})
                return reply
            if sent < total:
                await asyncio.sleep(self.gap())
        prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": total,
            "total_tokens": prompt_tokens + total,
        }
        if body.get("stream_options", {}).get("include_usage"):
            await _send(reply, {"choices": [], "usage": usage})
        await reply.write(b"data: [DONE]\n\n")
        return reply


def _chunk(chat: bool, text: str) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}


async def _send(reply: web.StreamResponse, payload: dict[str, Any]) -> None:
    await reply.write(f"data: {json.dumps(payload)}\n\n".encode())
