"""Stream one request to an OpenAI-compatible server and time its chunks.

Timing follows vLLM's `bench serve`: the send time is taken just before the POST, and
every SSE chunk with non-empty `choices` is a token chunk (the first gives TTFT, the last
E2EL). Output tokens come from the final `usage` chunk (`stream_options.include_usage`).
Failures are recorded by kind, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from loadtest.request import BenchRequest, RequestRecord


@dataclass(slots=True, frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    endpoint: str = "completions"  # completions | chat
    ignore_eos: bool = True
    api_key: str = ""
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be completions or chat")

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        return base + ("/chat/completions" if self.endpoint == "chat" else "/completions")


def build_body(cfg: ClientConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts; use --endpoint completions")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_request(
    session: aiohttp.ClientSession, cfg: ClientConfig, req: BenchRequest
) -> RequestRecord:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    record = RequestRecord(label=req.label, send=time.perf_counter())
    text_chunks = 0
    try:
        async with (
            asyncio.timeout(cfg.timeout_s),
            session.post(cfg.url, json=build_body(cfg, req), headers=headers) as reply,
        ):
            if reply.status != 200:
                record.error = f"http_{reply.status}"
                record.error_detail = (await reply.text())[:300]
                return record
            async for raw in reply.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                message = json.loads(data)
                if "error" in message:
                    record.error = "stream_error"
                    record.error_detail = json.dumps(message["error"])[:300]
                    return record
                if choices := message.get("choices"):
                    record.chunk_times.append(now)
                    text_chunks += bool(_chunk_text(choices[0]))
                if usage := message.get("usage"):
                    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    record.output_tokens = int(usage.get("completion_tokens") or 0)
                    record.usage_reported = True
    except TimeoutError:
        record.error = "timeout"
    except aiohttp.ClientConnectionError as exc:
        record.error, record.error_detail = "connection", repr(exc)[:300]
    except (aiohttp.ClientError, json.JSONDecodeError) as exc:
        record.error, record.error_detail = "protocol", repr(exc)[:300]
    finally:
        record.end = time.perf_counter()
    if not record.error and not record.chunk_times:
        record.error = "empty_stream"
    if not record.usage_reported:
        record.output_tokens = text_chunks
    return record
