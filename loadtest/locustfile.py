"""The bundled scenarios as real Locust users, for teams that already run Locust.

    pip install 'splitserve[locust]'
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless \
        --users 8 --spawn-rate 2 --run-time 60s            # mixed: all three classes
    locust -f loadtest/locustfile.py ... RagUser           # one scenario

Each request streams from /v1/chat/completions; besides Locust's own entry (the whole
request), TTFT and TPOT are recorded as custom events (request types "TTFT" and "TPOT",
milliseconds; TPOT from the server's usage, as vLLM defines it). Set LOADTEST_MODEL to skip
asking GET /v1/models.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

from loadtest.client import ClientConfig, build_body
from loadtest.request import BenchRequest
from loadtest.scenarios import CHAT, LONG_PROMPT, RAG
from loadtest.users import UserClass


class ScenarioUser(HttpUser):
    abstract = True
    scenario: UserClass = CHAT

    def on_start(self) -> None:
        self.rng = random.Random()
        model = (
            os.environ.get("LOADTEST_MODEL")
            or self.client.get("/v1/models").json()["data"][0]["id"]
        )
        self.config = ClientConfig(self.host or "", model, "chat")

    @task
    def run_task(self) -> None:
        self.stream(self.scenario.pick(self.rng).make(self.rng))

    def stream(self, req: BenchRequest) -> None:
        body = build_body(self.config, req)
        send = time.perf_counter()
        chunks: list[float] = []
        tokens = 0
        with self.client.post("/v1/chat/completions", json=body, stream=True,
                              catch_response=True, name=req.label) as reply:  # fmt: skip
            if reply.status_code != 200:
                reply.failure(f"http_{reply.status_code}")
                return
            for line in reply.iter_lines():
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                message = json.loads(line[5:])
                if "error" in message:
                    reply.failure("stream_error")
                    return
                if message.get("choices"):
                    chunks.append(time.perf_counter())
                if usage := message.get("usage"):
                    tokens = int(usage.get("completion_tokens") or 0)
            if not chunks:
                reply.failure("empty_stream")
                return
            reply.success()
        self._event("TTFT", req.label, chunks[0] - send)
        if tokens > 1:
            self._event("TPOT", req.label, (chunks[-1] - chunks[0]) / (tokens - 1))

    def _event(self, kind: str, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=seconds * 1000, response_length=0,
            exception=None, context={},
        )  # fmt: skip


class ChatUser(ScenarioUser):
    scenario = CHAT
    weight = CHAT.weight
    wait_time = between(1, 3)


class RagUser(ScenarioUser):
    scenario = RAG
    weight = RAG.weight
    wait_time = between(1, 3)


class LongPromptUser(ScenarioUser):
    scenario = LONG_PROMPT
    weight = LONG_PROMPT.weight
    wait_time = between(2, 5)
