"""The gateway integration tests' harness: a real nats-server, a fake scheduler+worker
(written with `Bus`) that answers StatusQuery and SubmitRequest, streams a scripted TokenChunk
sequence to the gateway's token subject and records Cancels, and the gateway on a real port,
the two sharing one event loop in a background thread. `gw` is the gateway; `fim_gw` a second
one whose tokenizer has fill-in-the-middle tokens, for `suffix`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
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
from shared.lora_messages import AdapterAction, AdapterAnswer, AdapterCommand, AdapterReport
from shared.nats_server import NatsServer
from shared.ports import free_port
from shared.protocol import (
    Cancel,
    FinishReason,
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

NAMESPACE = "gwtest"
MODEL = "smol"
KEY = "sk-test"
REPLY = "Hi there! 😀 你好"
MAX_MODEL_LEN = 128
NO_SCHEDULER_GRACE_S = 1.0  # a submit nobody subscribes to is asked again this long
Script = list[tuple[list[int], str | None, str]]  # (token ids, "stop"/"length"/None, error)


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
    adapters: list[str] = field(default_factory=list)  # LoRA adapters its workers announce
    adapter_commands: list[AdapterCommand] = field(default_factory=list)

    async def start(self) -> None:
        await self.bus.serve(self.subjects.status, StatusQuery, self._status, lambda _: None)
        self.submit_sub = await self.serve_submit()
        await self.bus.subscribe(self.subjects.cancel, Cancel, self._cancel)
        refuse = lambda why: AdapterReport(error=why)  # noqa: E731
        await self.bus.serve(self.subjects.adapters, AdapterCommand, self._adapters, refuse)
        await self.bus.nc.flush()

    async def serve_submit(self):
        bad = lambda why: SubmitAck("", Outcome.FAILED, why)  # noqa: E731
        return await self.bus.serve(self.subjects.submit, SubmitRequest, self._submit, bad)

    async def _status(self, query: StatusQuery, headers: dict) -> MeshStatus:
        beats = [
            Heartbeat(f"w{i}", r, MODEL, 0, 0, 10, 10, 16, adapters=list(self.adapters))
            for i, r in enumerate(self.roles)
        ]
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
            if error and request.attempt:
                continue  # a migrated attempt plays the script without its errors
            reason = None if finish is None else FinishReason[finish.upper()]
            chunk = TokenChunk(request.request_id, index, ids, finish_reason=reason, error=error)
            if ids:
                self.log.append(("token", request.request_id))
            await self.bus.publish(subject, chunk)
            if i == 0:
                await self.bus.publish(subject, chunk)  # a duplicate: dropped by index
            index += len(ids)
            await asyncio.sleep(0.01)

    async def _adapters(self, command: AdapterCommand, headers: dict) -> AdapterReport:
        """Every worker loads (unloads) it, unless its path has "bad" in it."""
        self.adapter_commands.append(command)
        if "bad" in command.path:
            return AdapterReport([AdapterAnswer("w0", Outcome.INVALID, "no adapter_config.json")])
        if command.action == AdapterAction.LOAD:
            self.adapters.append(command.name)
        else:
            self.adapters.remove(command.name)
        return AdapterReport([AdapterAnswer(f"w{i}", Outcome.OK) for i in range(len(self.roles))])

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
        scheduler_grace=NO_SCHEDULER_GRACE_S,
        migration_limit=0,  # the fake mesh plays one attempt; migration: test_chaos.py
    )


async def start_gateway(config: GatewayConfig) -> web.AppRunner:
    runner = create_runner(config)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    return runner


@pytest.fixture(scope="module", name="gw")
def gw_fixture(nats_server: NatsServer, real_model_dir: Path) -> Iterator[Harness]:  # noqa: F811
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


@pytest.fixture(scope="module", name="fim_gw")
def fim_gw_fixture(
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


@pytest.fixture(scope="module", name="migrating_gw")
def migrating_gw_fixture(
    gw: Harness,
    nats_server: NatsServer,
    real_model_dir: Path,  # noqa: F811
) -> Iterator[Harness]:
    """A second gateway on the same fake mesh that migrates a failed attempt once."""
    config = gateway_config(nats_server, real_model_dir, "gw-mig")
    config = dataclasses.replace(config, migration_limit=1)
    runner = gw.run(start_gateway(config))
    yield Harness(f"http://127.0.0.1:{config.port}", gw.mesh, gw.loop, gw.text)
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
