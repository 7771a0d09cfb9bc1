"""Server-sent events in the OpenAI format: `data: {json}` blocks, then `data: [DONE]`.

Headers keep proxies and browsers from buffering (`Cache-Control: no-cache`,
`X-Accel-Buffering: no`). While the stream is silent (a long queue or prefill), a comment
line `: keep-alive` goes out every `sse_heartbeat` seconds, which SSE parsers ignore, so
idle timeouts in proxies and browsers do not cut the stream. The heartbeat stops when the
stream ends, fails, or the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from services.gateway.keys import CONFIG

HEARTBEAT = b": keep-alive\n\n"


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
        self.interval = request.app[CONFIG].sse_heartbeat
        self.last_write = 0.0  # loop time
        self.heartbeat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.response.prepare(self.request)
        self.last_write = asyncio.get_running_loop().time()
        self.heartbeat = asyncio.create_task(self._beat())

    async def send(self, data: dict[str, Any], event: str = "") -> None:
        """One event; `event` names it in an `event:` line (the Responses API's events)."""
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        name = f"event: {event}\n" if event else ""
        await self._write(f"{name}data: {payload}\n\n".encode())

    async def done(self) -> web.StreamResponse:
        await self._stop_heartbeat()
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response

    async def _write(self, data: bytes) -> None:
        # One write() per event: a heartbeat can only land between two whole events.
        self.last_write = asyncio.get_running_loop().time()
        await self.response.write(data)

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(self.last_write + self.interval - loop.time())
                transport = self.request.transport
                if transport is None or transport.is_closing():
                    return
                if loop.time() - self.last_write >= self.interval:
                    await self._write(HEARTBEAT)
        except (ConnectionError, RuntimeError):
            return  # the client went away; the handler finds out on its own next write

    async def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.heartbeat
