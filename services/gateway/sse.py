"""Server-sent events in the OpenAI format: `data: {json}` blocks, then `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class SSEWriter:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, data: dict[str, Any]) -> None:
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data: {payload}\n\n".encode())

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
