"""The gateway over a real nats-server, called with the official openai SDK.

A fake scheduler+worker (written here with `Bus`) answers StatusQuery and SubmitRequest,
streams a scripted TokenChunk sequence to the gateway's token subject and records Cancels.
The gateway and the fake share one event loop in a background thread; the tests call the
gateway over a real port with the synchronous SDK.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from aiohttp import web

from services.gateway.app import create_runner
from services.gateway.config import GatewayConfig
from services.gateway.prompting import ModelText
from shared.bus import Bus
from shared.config import CommonConfig
from shared.nats_server import NatsServer, free_port
from shared.protocol import (
    Cancel,
    Heartbeat,
    MeshStatus,
    StatusQuery,
    SubmitAck,
    SubmitRequest,
    TokenChunk,
    WorkerStatus,
)
from shared.subjects import Subjects
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e
NAMESPACE = "gwtest"
MODEL = "smol"
KEY = "sk-test"
REPLY = "Hi there! 😀 你好"
MAX_MODEL_LEN = 128
Script = list[tuple[list[int], str | None, str]]  # (token ids, finish_reason, error)


@dataclass
class FakeMesh:
    """Scheduler + worker in one: what the gateway sees of the mesh."""

    bus: Bus
    subjects: Subjects
    roles: list[str] = field(default_factory=lambda: ["prefill", "decode"])
    script: Script = field(default_factory=list)
    hang: bool = False  # after the script, send nothing more
    refuse: bool = False
    submitted: list[SubmitRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def start(self) -> None:
        await self.bus.serve(self.subjects.status, StatusQuery, self._status, lambda _: None)
        self.submit_sub = await self.serve_submit()
        await self.bus.subscribe(self.subjects.cancel, Cancel, self._cancel)
        await self.bus.nc.flush()

    async def serve_submit(self):
        bad = lambda why: SubmitAck("", False, why)  # noqa: E731
        return await self.bus.serve(self.subjects.submit, SubmitRequest, self._submit, bad)

    async def _status(self, query: StatusQuery, headers: dict) -> MeshStatus:
        beats = [Heartbeat(f"w{i}", r, MODEL, 0, 0, 10, 10, 16) for i, r in enumerate(self.roles)]
        return MeshStatus([WorkerStatus(b, time.time()) for b in beats], 0, 0, 0)

    async def _submit(self, request: SubmitRequest, headers: dict) -> SubmitAck:
        self.submitted.append(request)
        if self.refuse:
            return SubmitAck(request.request_id, False, "queue full", retry_after=2.5)
        asyncio.get_running_loop().create_task(self._stream(request, list(self.script)))
        return SubmitAck(request.request_id, True, prefill_worker="w0", decode_worker="w1")

    async def _stream(self, request: SubmitRequest, script: Script) -> None:
        subject = self.subjects.tokens(request.gateway_id)
        index = 0
        for i, (ids, finish, error) in enumerate(script):
            chunk = TokenChunk(request.request_id, index, ids, finish_reason=finish, error=error)
            await self.bus.publish(subject, chunk)
            if i == 0:
                await self.bus.publish(subject, chunk)  # a duplicate: dropped by index
            index += len(ids)
            await asyncio.sleep(0.01)

    async def _cancel(self, cancel: Cancel, headers: dict) -> None:
        self.cancelled.append(cancel.request_id)


@dataclass
class Harness:
    url: str
    mesh: FakeMesh
    loop: asyncio.AbstractEventLoop
    text: ModelText

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def run(self, coro) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def reply_script(self, finish: str = "stop", chunk: int = 2) -> list[int]:
        ids = self.text.tokenizer.encode(REPLY, add_special_tokens=False).ids
        script: Script = [(ids[i : i + chunk], None, "") for i in range(0, len(ids), chunk)]
        eos = self.text.tokenizer.token_to_id("<|im_end|>")
        script.append(([eos], "stop", "") if finish == "stop" else ([], "length", ""))
        self.mesh.script, self.mesh.hang, self.mesh.refuse = script, False, False
        return ids + ([eos] if finish == "stop" else [])

    def wait_cancelled(self, request_id: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if request_id in self.mesh.cancelled:
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="module")
def gw(nats_server: NatsServer, real_model_dir: Path) -> Iterator[Harness]:  # noqa: F811
    config = GatewayConfig(
        common=CommonConfig(nats_server.url, NAMESPACE, "INFO"),
        model_dir=real_model_dir,
        served_model_name=MODEL,
        gateway_id="gw1",
        max_model_len=MAX_MODEL_LEN,
        port=free_port(),
        api_keys=("other-key", KEY),
        stall_timeout=2.0,
        migration_limit=0,  # the fake mesh plays one attempt; migration: test_chaos.py
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[web.AppRunner, FakeMesh]:
        mesh = FakeMesh(await Bus.connect(nats_server.url, "fake-mesh"), Subjects(NAMESPACE))
        await mesh.start()
        runner = create_runner(config)
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        return runner, mesh

    runner, mesh = asyncio.run_coroutine_threadsafe(start(), loop).result(20)
    harness = Harness(f"http://127.0.0.1:{config.port}", mesh, loop, ModelText.load(real_model_dir))
    yield harness
    harness.run(runner.cleanup())
    harness.run(mesh.bus.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def http(gw: Harness, path: str, body: bytes | None = None, key: str = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(gw.url + path, data=body, method="POST" if body else "GET")
    request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


MESSAGES = [{"role": "user", "content": "Say hi"}]


def test_chat_non_streaming(gw: Harness) -> None:
    ids = gw.reply_script()
    reply = gw.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert reply.choices[0].message.content == REPLY
    assert reply.choices[0].finish_reason == "stop"
    prompt = gw.text.chat_prompt_ids(MESSAGES)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(ids))
    assert reply.usage.total_tokens == len(prompt) + len(ids)
    sent = gw.mesh.submitted[-1]
    assert sent.gateway_id == "gw1" and sent.prompt_token_ids == prompt
    assert sent.sampling.temperature == 0.0
    assert sent.sampling.max_tokens == MAX_MODEL_LEN - len(prompt)
    assert sent.deadline > time.time() + 500


def test_chat_streaming_with_usage(gw: Harness) -> None:
    ids = gw.reply_script(chunk=1)  # one token a chunk: the emoji spans several
    chunks = list(
        gw.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY and "\ufffd" not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


def test_completions_length(gw: Harness) -> None:
    ids = gw.reply_script(finish="length")
    client = gw.client()
    reply = client.completions.create(model=MODEL, prompt="Once", max_tokens=len(ids))
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (REPLY, "length")
    assert reply.usage.completion_tokens == len(ids)
    assert gw.mesh.submitted[-1].sampling.max_tokens == len(ids)
    chunks = list(client.completions.create(model=MODEL, prompt=[[1, 2, 3]], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == REPLY
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_and_cancels(gw: Harness) -> None:
    gw.reply_script(chunk=1)
    reply = gw.client().chat.completions.create(model=MODEL, messages=MESSAGES, stop=["ere!"])
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("Hi th", "stop")
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id)


def test_client_disconnect_cancels(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.script = gw.mesh.script[:1]  # then nothing: the request stays in flight
    stream = gw.client().chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    next(iter(stream))
    stream.close()
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id, timeout=1.5)


def test_stall_and_worker_error(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.script = gw.mesh.script[:1]
    with pytest.raises(openai.InternalServerError) as info:
        gw.client().completions.create(model=MODEL, prompt="x")
    assert info.value.status_code == 504 and "no token" in info.value.message
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id)
    gw.mesh.script = [([5], None, ""), ([], None, "decode worker out of memory")]
    stream = gw.client().completions.create(model=MODEL, prompt="x", stream=True)
    with pytest.raises(openai.APIError, match="out of memory"):
        list(stream)


def test_bad_requests_name_the_field(gw: Harness) -> None:
    status, body = http(gw, "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    long_prompt = "word " * MAX_MODEL_LEN
    cases = [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 5}, "temperature"),
        ({"model": "gpt-4"}, "model"),
        ({"messages": [{"role": "user", "content": long_prompt}]}, "messages"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "messages": MESSAGES} | extra
        with pytest.raises(openai.BadRequestError) as info:
            gw.client().chat.completions.create(**body)
        assert info.value.body["param"] == param, extra


def test_overload_and_no_scheduler(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.refuse = True
    with pytest.raises(openai.RateLimitError) as info:
        gw.client().completions.create(model=MODEL, prompt="x")
    assert info.value.response.headers["Retry-After"] == "3"
    gw.mesh.refuse = False
    gw.run(gw.mesh.submit_sub.unsubscribe())
    try:
        with pytest.raises(openai.InternalServerError) as info:
            gw.client().completions.create(model=MODEL, prompt="x")
        assert info.value.status_code == 503 and "no scheduler" in info.value.message
    finally:
        gw.mesh.submit_sub = gw.run(gw.mesh.serve_submit())


def test_api_key_models_health(gw: Harness) -> None:
    with pytest.raises(openai.AuthenticationError):
        gw.client(api_key="wrong").models.list()
    assert [m.id for m in gw.client().models.list()] == [MODEL]
    assert http(gw, "/health", key="wrong")[0] == 200


@pytest.mark.parametrize(
    ("roles", "status"),
    [([], 503), (["prefill"], 503), (["decode", "decode"], 503), (["prefill", "decode"], 200)]
    + [(["both"], 200)],
)
def test_ready_needs_both_roles(gw: Harness, roles: list[str], status: int) -> None:
    gw.mesh.roles = roles
    assert http(gw, "/ready", key="none")[0] == status


def test_gateway_never_imports_torch() -> None:
    code = "import sys, services.gateway.app, services.gateway.cli; print('torch' in sys.modules)"
    root = Path(__file__).parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
