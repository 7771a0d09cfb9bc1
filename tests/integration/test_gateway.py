"""The gateway over a real nats-server, called with the official openai SDK.

A fake scheduler+worker (written here with `Bus`) answers StatusQuery and SubmitRequest,
streams a scripted TokenChunk sequence to the gateway's token subject and records Cancels.
The gateway and the fake share one event loop in a background thread; the tests call the
gateway over a real port with the synchronous SDK. A second gateway serves a copy of the
tokenizer with fill-in-the-middle tokens added, for `suffix`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
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
from tokenizers import Tokenizer

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
    Outcome,
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
    refuse_ending: str = ""  # refuse the request ids that end so
    refusal: Outcome = Outcome.BUSY  # how refused requests are answered
    submitted: list[SubmitRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    log: list[tuple[str, str]] = field(default_factory=list)  # ("submit" | "token", id), in order

    async def start(self) -> None:
        await self.bus.serve(self.subjects.status, StatusQuery, self._status, lambda _: None)
        self.submit_sub = await self.serve_submit()
        await self.bus.subscribe(self.subjects.cancel, Cancel, self._cancel)
        await self.bus.nc.flush()

    async def serve_submit(self):
        bad = lambda why: SubmitAck("", Outcome.FAILED, why)  # noqa: E731
        return await self.bus.serve(self.subjects.submit, SubmitRequest, self._submit, bad)

    async def _status(self, query: StatusQuery, headers: dict) -> MeshStatus:
        beats = [Heartbeat(f"w{i}", r, MODEL, 0, 0, 10, 10, 16) for i, r in enumerate(self.roles)]
        return MeshStatus([WorkerStatus(b, time.time()) for b in beats], 0, 0, 0)

    async def _submit(self, request: SubmitRequest, headers: dict) -> SubmitAck:
        self.submitted.append(request)
        self.log.append(("submit", request.request_id))
        refused = self.refuse_ending and request.request_id.endswith(self.refuse_ending)
        if self.refuse or refused:
            error = "queue full" if self.refusal == Outcome.BUSY else f"{self.refusal.name} here"
            return SubmitAck(request.request_id, self.refusal, error, retry_after=2.5)
        asyncio.get_running_loop().create_task(self._stream(request, list(self.script)))
        return SubmitAck(request.request_id, Outcome.OK, prefill_worker="w0", decode_worker="w1")

    async def _stream(self, request: SubmitRequest, script: Script) -> None:
        subject = self.subjects.tokens(request.gateway_id)
        index = 0
        for i, (ids, finish, error) in enumerate(script):
            if request.request_id in self.cancelled:
                return
            chunk = TokenChunk(request.request_id, index, ids, finish_reason=finish, error=error)
            if ids:
                self.log.append(("token", request.request_id))
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
        self.mesh.refuse_ending, self.mesh.refusal = "", Outcome.BUSY
        return ids + ([eos] if finish == "stop" else [])

    def wait_cancelled(self, request_id: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if request_id in self.mesh.cancelled:
                return True
            time.sleep(0.05)
        return False


def gateway_config(nats_server: NatsServer, model_dir: Path, gateway_id: str) -> GatewayConfig:
    return GatewayConfig(
        common=CommonConfig(nats_server.url, NAMESPACE, "INFO"),
        model_dir=model_dir,
        served_model_name=MODEL,
        gateway_id=gateway_id,
        max_model_len=MAX_MODEL_LEN,
        port=free_port(),
        api_keys=("other-key", KEY),
        stall_timeout=2.0,
        migration_limit=0,  # the fake mesh plays one attempt; migration: test_chaos.py
    )


async def start_gateway(config: GatewayConfig) -> web.AppRunner:
    runner = create_runner(config)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    return runner


@pytest.fixture(scope="module")
def gw(nats_server: NatsServer, real_model_dir: Path) -> Iterator[Harness]:  # noqa: F811
    config = gateway_config(nats_server, real_model_dir, "gw1")
    yield from run_gateway(nats_server, config, real_model_dir)


def run_gateway(
    nats_server: NatsServer, config: GatewayConfig, model_dir: Path
) -> Iterator[Harness]:
    """A gateway with `config` and a fake mesh on their own loop thread, until closed."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[web.AppRunner, FakeMesh]:
        mesh = FakeMesh(await Bus.connect(nats_server.url, "fake-mesh"), Subjects(NAMESPACE))
        await mesh.start()
        return await start_gateway(config), mesh

    runner, mesh = asyncio.run_coroutine_threadsafe(start(), loop).result(20)
    harness = Harness(f"http://127.0.0.1:{config.port}", mesh, loop, ModelText.load(model_dir))
    yield harness
    harness.run(runner.cleanup())
    harness.run(mesh.bus.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture(scope="module")
def fim_gw(
    gw: Harness,
    nats_server: NatsServer,
    real_model_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Harness]:
    """A second gateway on the same fake mesh, its tokenizer given Qwen's FIM tokens."""
    model_dir = tmp_path_factory.mktemp("fim-tokenizer")
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    shutil.copy(real_model_dir / "tokenizer_config.json", model_dir)
    config = gateway_config(nats_server, model_dir, "gw-fim")
    runner = gw.run(start_gateway(config))
    yield Harness(f"http://127.0.0.1:{config.port}", gw.mesh, gw.loop, ModelText.load(model_dir))
    gw.run(runner.cleanup())


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
        ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "messages": MESSAGES} | extra
        with pytest.raises(openai.BadRequestError) as info:
            gw.client().chat.completions.create(**body)
        assert info.value.body["param"] == param, extra


def test_overload_and_no_scheduler(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.refuse = True
    with pytest.raises(openai.RateLimitError) as info:  # BUSY: the scheduler's queue is full
        gw.client().completions.create(model=MODEL, prompt="x")
    assert info.value.response.headers["Retry-After"] == "3"
    for outcome in (Outcome.UNAVAILABLE, Outcome.FAILED):  # no worker took it: never a 400
        gw.mesh.refusal = outcome
        with pytest.raises(openai.InternalServerError) as info:
            gw.client().completions.create(model=MODEL, prompt="x")
        assert info.value.status_code == 503 and f"{outcome.name} here" in info.value.message
        assert info.value.response.headers["Retry-After"] == "3"
    gw.mesh.refusal = Outcome.INVALID
    with pytest.raises(openai.BadRequestError) as bad:
        gw.client().completions.create(model=MODEL, prompt="x")
    assert bad.value.body["message"] == "invalid request: INVALID here"
    gw.mesh.refuse, gw.mesh.refusal = False, Outcome.BUSY
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


def choice_requests(gw: Harness, count: int) -> list[SubmitRequest]:
    """The last `count` submits, which must be the choices of one request, in order."""
    sent = gw.mesh.submitted[-count:]
    base = sent[0].request_id.removesuffix("-0")
    assert [r.request_id for r in sent] == [f"{base}-{i}" for i in range(count)]
    return sent


def test_n_choices_go_after_the_first_token_with_their_own_seeds(gw: Harness) -> None:
    gw.reply_script()
    client = gw.client()
    reply = client.completions.create(model=MODEL, prompt="Once", n=3, seed=5, max_tokens=20)
    assert [(c.index, c.text) for c in reply.choices] == [(i, REPLY) for i in range(3)]
    sent = choice_requests(gw, 3)
    assert [r.sampling.seed for r in sent] == [5, 6, 7]
    assert all(r.prompt_token_ids == sent[0].prompt_token_ids for r in sent)
    log = gw.mesh.log
    first_token = log.index(("token", sent[0].request_id))
    assert log.index(("submit", sent[0].request_id)) < first_token
    assert first_token < log.index(("submit", sent[1].request_id))
    assert first_token < log.index(("submit", sent[2].request_id))
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [REPLY, REPLY]
    unseeded = choice_requests(gw, 2)
    assert unseeded[0].sampling.seed != unseeded[1].sampling.seed  # each drew its own


def test_first_choice_failing_before_its_first_token_submits_no_sibling(gw: Harness) -> None:
    gw.reply_script()
    gw.mesh.script = [([], None, "prefill worker out of memory")]
    submits = len(gw.mesh.submitted)
    with pytest.raises(openai.InternalServerError, match="out of memory"):
        gw.client().completions.create(model=MODEL, prompt="x", n=4)
    assert len(gw.mesh.submitted) == submits + 1
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id)
    gw.mesh.script = []  # accepted, then silence: the stall timeout ends it
    stream = gw.client().completions.create(model=MODEL, prompt="x", n=4, stream=True)
    with pytest.raises(openai.APIError, match="no token"):
        list(stream)
    assert len(gw.mesh.submitted) == submits + 2
    assert gw.wait_cancelled(gw.mesh.submitted[-1].request_id)


def test_a_refused_sibling_is_retried_then_fails_the_request(gw: Harness) -> None:
    gw.reply_script()
    word = gw.text.tokenizer.encode(" word").ids
    gw.mesh.script = [(word, None, "")] * 400  # choice 0 streams for longer than the retries
    gw.mesh.refuse_ending = "-1"
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError, match="choice 1 was refused"):
        gw.client().completions.create(model=MODEL, prompt="x", n=3)
    assert time.monotonic() - started >= 1.0  # retried within the stall timeout (2 s)
    base = gw.mesh.submitted[-1].request_id.removesuffix("-1")
    ids = [r.request_id for r in gw.mesh.submitted if r.request_id.startswith(base)]
    assert ids[0] == f"{base}-0" and ids.count(f"{base}-1") >= 2 and f"{base}-2" not in ids
    assert gw.wait_cancelled(f"{base}-0")  # choice 0 was still streaming: it is cancelled


def test_suffix_is_a_fill_in_the_middle_prompt(gw: Harness, fim_gw: Harness) -> None:
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    with pytest.raises(openai.BadRequestError) as info:
        gw.client().completions.create(model=MODEL, prompt=prefix, suffix=suffix)
    assert info.value.body["param"] == "suffix"
    assert "no fill-in-the-middle tokens" in info.value.body["message"]
    fim_gw.reply_script()
    client = fim_gw.client()
    reply = client.completions.create(model=MODEL, prompt=prefix, suffix=suffix, max_tokens=30)
    assert reply.choices[0].text == REPLY
    tokenizer = fim_gw.text.tokenizer
    pre, suf, mid = (
        tokenizer.token_to_id(f"<|fim_{part}|>") for part in ("prefix", "suffix", "middle")
    )
    encode = tokenizer.encode
    expected = [pre, *encode(prefix).ids, suf, *encode(suffix).ids, mid]
    assert gw.mesh.submitted[-1].prompt_token_ids == expected
    assert reply.usage.prompt_tokens == len(expected)
    echoed = client.completions.create(
        model=MODEL, prompt=prefix, suffix=suffix, echo=True, stream=True, max_tokens=30
    )
    assert "".join(c.choices[0].text for c in echoed) == prefix + REPLY
    assert gw.mesh.submitted[-1].prompt_token_ids == expected
