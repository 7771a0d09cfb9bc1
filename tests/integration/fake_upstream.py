"""A stand-in for an external OpenAI-compatible server, run as its own process:
`python -m tests.integration.fake_upstream PORT`. It answers every chat or text completion
with "upstream <model it was asked for>", streamed or not; asked for the model "hang", it
sends nothing for a minute (a server that accepts connections but does not answer)."""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web


async def complete(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model = body["model"]
    if model == "hang":
        await asyncio.sleep(60)
    chat = request.path.endswith("/chat/completions")
    text = f"upstream {model}"
    choice = {"index": 0, "finish_reason": "stop"}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    if not body.get("stream"):
        return web.json_response({"id": "up-1", "object": "chat.completion", "model": model,
                                  "choices": [choice]})  # fmt: skip
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await reply.prepare(request)
    for word in text.split():
        delta = (
            {"index": 0, "delta": {"content": word + " "}} if chat else {"index": 0, "text": word}
        )
        chunk = {
            "id": "up-1",
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [delta],
        }
        await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await reply.write(b"data: [DONE]\n\n")
    return reply


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)


if __name__ == "__main__":
    main()
