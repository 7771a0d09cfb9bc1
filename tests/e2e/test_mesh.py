"""The whole mesh as users run it: `splitserve up` (real nats-server, separate processes),
called with the official OpenAI SDK, checked against the engine run directly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import openai
import pytest
from tokenizers import Tokenizer

from services.gateway.prompting import ModelText
from services.offline import chat_prompt_ids
from shared.bus import Bus
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.nats_auth import MeshCredentials, mesh_nats_dir
from shared.ports import free_port
from shared.protocol import Heartbeat, MeshStatus, StatusQuery
from shared.subjects import Subjects
from tests.conftest import write_tiny_model
from tests.engine_harness import run_to_completion

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves falling in the park.",
    "Explain in one sentence why the sky is blue.",
]


@pytest.fixture(scope="module")
def mesh_model_dir(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the real tokenizer and chat template: fast, yet text."""
    model_dir = write_tiny_model(
        tmp_path_factory.mktemp("mesh-model"),
        seed=3,
        vocab_size=49152,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_model_dir / name, model_dir / name)
    return model_dir


class Mesh:
    def __init__(self, model_dir: Path, home: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.nats_port = free_port()
        self.log_path = home / "up.log"
        self.credentials = MeshCredentials(mesh_nats_dir(home, self.port) / "auth")  # up's own
        env = {**os.environ, "SPLITSERVE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "up",
                "--model-dir",
                str(model_dir),
                "--port",
                str(self.port),
                "--nats-port",
                str(self.nats_port),
                *extra,
            ],
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", timeout=60)

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"splitserve up exited:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.base}/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()  # first: a hung child's thread stacks go into the log (launcher)
        raise AssertionError(f"mesh not ready in {timeout}s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def status(self, patience: float = 10.0) -> MeshStatus:
        """The scheduler's view of the workers, from their latest heartbeats. Asked again
        for up to `patience` seconds while no scheduler answers: one whose NATS node was
        just killed takes a moment (longer on a loaded host) to resubscribe on another."""

        async def ask() -> MeshStatus:
            own = self.credentials.directory.exists()
            auth = self.credentials.auth("observer") if own else None
            bus = await Bus.connect(f"nats://127.0.0.1:{self.nats_port}", "test", auth=auth)
            deadline = time.monotonic() + patience
            try:
                while True:
                    try:
                        return await bus.request(Subjects().status, StatusQuery(), MeshStatus, 5)
                    except nats.errors.NoRespondersError:
                        if time.monotonic() >= deadline:
                            raise
                        await asyncio.sleep(0.1)
            finally:
                await bus.close()

        return asyncio.run(ask())

    def next_heartbeats(self) -> list[Heartbeat]:
        """Heartbeats sent after this call (each worker beats once a second)."""
        time.sleep(1.5)
        return [w.heartbeat for w in self.status().workers]

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.base + path, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


def start_mesh(
    model_dir: Path, home: Path, extra: list[str], ready_timeout: float = 90
) -> Iterator[Mesh]:
    mesh = Mesh(model_dir, home, extra)
    try:
        mesh.wait_ready(ready_timeout)
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def mesh(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:
    # The fixed path rule (prompts of over 16 uncached tokens split), which these tests
    # exercise: measured costs would keep an idle mesh's prompts on the decode worker
    # (tests/integration/test_scheduler_paths.py tests that choice).
    flags = ["--path-choice", "fixed"]
    yield from start_mesh(mesh_model_dir, tmp_path_factory.mktemp("home"), flags)


def engine_text(model_dir: Path, message: str, max_tokens: int) -> tuple[str, int, int]:
    """(text, prompt tokens, completion tokens) of a greedy chat run on the engine alone."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = chat_prompt_ids(model_dir, tokenizer, message)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=256))
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens = run_to_completion(engine)["r"]
    return tokenizer.decode(tokens, skip_special_tokens=True), len(prompt), len(tokens)


def test_streaming_and_plain_chat_equal_the_engine(mesh, mesh_model_dir):
    model = mesh.client.models.list().data[0].id
    for message in PROMPTS:
        text, prompt_tokens, completion_tokens = engine_text(mesh_model_dir, message, 24)
        reply = mesh.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": message}],
            max_tokens=24,
            temperature=0,
        )
        assert reply.choices[0].message.content == text
        assert reply.usage.prompt_tokens == prompt_tokens
        assert reply.usage.completion_tokens == completion_tokens
        stream = mesh.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": message}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert "".join(pieces) == text
        assert usage.completion_tokens == completion_tokens


def test_sixteen_concurrent_streams_complete(mesh):
    model = mesh.client.models.list().data[0].id

    def one(i: int) -> tuple[int, int, str]:
        stream = mesh.client.completions.create(
            model=model,
            prompt=f"Request number {i}: " + "tell me a story " * (i % 5 + 1),
            max_tokens=8 + 3 * i,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        finish, usage = None, None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return i, usage.completion_tokens, finish

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for i, completion_tokens, finish in results:
        assert finish in ("stop", "length"), i
        if finish == "length":
            assert completion_tokens == 8 + 3 * i


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
            "max_tokens",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}',
            "temperature",
        ),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ],
)
def test_bad_inputs_get_a_400_naming_the_field(mesh, body, param):
    model = mesh.client.models.list().data[0].id
    status, reply = mesh.post("/v1/chat/completions", body.replace(b'"m"', f'"{model}"'.encode()))
    assert status == 400
    assert reply["error"]["message"]
    if param:
        assert reply["error"]["param"] == param
    assert mesh.client.completions.create(model=model, prompt="still there?", max_tokens=2)


def test_over_long_prompt_is_refused_and_the_mesh_keeps_serving(mesh):
    model = mesh.client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError):
        mesh.client.completions.create(model=model, prompt="word " * 3000, max_tokens=4)
    assert mesh.client.completions.create(model=model, prompt="hello", max_tokens=2)


def test_a_shared_prefix_transfers_fewer_kv_blocks(mesh):
    model = mesh.client.models.list().data[0].id
    prefix = "You are a careful assistant. Here is the shared context: " + "lorem ipsum " * 60

    def blocks_sent_for(prompt: str) -> int:
        before = sum(b.kv_blocks_sent for b in mesh.next_heartbeats())
        mesh.client.completions.create(model=model, prompt=prompt, max_tokens=2)
        return sum(b.kv_blocks_sent for b in mesh.next_heartbeats()) - before

    first = blocks_sent_for(prefix + "First question: why?")
    second = blocks_sent_for(prefix + "Second question: how?")
    assert first >= 8, "the first prompt's blocks travel from prefill to decode"
    assert second < first / 2, (first, second)
    received = sum(b.kv_blocks_received for b in mesh.next_heartbeats())
    assert received >= first + second


def test_real_model_client_disconnect_frees_every_block(real_model_dir, tmp_path):
    """The real model (one end-to-end run at its real speed): the answer is right, and a
    client that leaves mid-stream gets every block freed on both workers."""
    for mesh in start_mesh(real_model_dir, tmp_path, []):
        _check_real_answer_then_disconnect(mesh)


def _check_real_answer_then_disconnect(mesh: Mesh) -> None:
    model = mesh.client.models.list().data[0].id
    reply = mesh.client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
    )
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    stream = mesh.client.completions.create(
        model=model,
        prompt="Count slowly: one, two, three,",
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for number, _ in enumerate(stream):
        if number == 5:
            break
    busy = mesh.next_heartbeats()
    assert any(b.free_blocks < b.total_blocks and b.role == "decode" for b in busy)
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        beats = mesh.next_heartbeats()
        if all(b.free_blocks == b.total_blocks and not b.num_requests for b in beats):
            return
    raise AssertionError(f"blocks still held after the client left: {beats}")


def test_aggregated_mode_serves_the_same_tokens(mesh, mesh_model_dir, tmp_path):
    model = mesh.client.models.list().data[0].id
    request = {"model": model, "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
    disaggregated = mesh.client.completions.create(**request).choices[0].text
    for aggregated in start_mesh(mesh_model_dir, tmp_path, ["--aggregated"]):
        assert aggregated.client.completions.create(**request).choices[0].text == disaggregated


def test_n_choices_share_the_prompt_blocks(mesh, mesh_model_dir):
    """n=4: choice 0 computes the prompt, the other three are submitted after its first token
    and find its full blocks in a prefix cache (the prefill worker's, or the decode worker's
    once they have moved there). Greedy choices equal the engine's output; sampled ones
    differ, each equal to the engine run with its own seed (seed + index)."""
    model = mesh.client.models.list().data[0].id
    text = ModelText.load(mesh_model_dir)
    prompt = f"Parallel sampling check {uuid.uuid4().hex}: " + "one two three four " * 12
    ids = text.completion_prompt_ids(prompt)
    block_size = mesh.next_heartbeats()[0].block_size
    if len(ids) % block_size == 0:  # a whole last block is always recomputed: avoid it
        prompt, ids = prompt + " five", text.completion_prompt_ids(prompt + " five")
    full_blocks = len(ids) // block_size
    assert full_blocks >= 4 and len(ids) % block_size

    def prefix_hits() -> int:
        return sum(b.prefix_hits for b in mesh.next_heartbeats())

    before = prefix_hits()
    request = {"model": model, "prompt": prompt, "n": 4, "max_tokens": 10}
    greedy = mesh.client.completions.create(**request, temperature=0)
    assert prefix_hits() - before >= 3 * full_blocks * block_size
    sampled = mesh.client.completions.create(**request, temperature=1.0, seed=11)
    engine = LLMEngine(EngineConfig(model_dir=mesh_model_dir, num_kv_blocks=256))
    engine.add_request("greedy", ids, SamplingParams(temperature=0.0, max_tokens=10))
    for i in range(4):
        engine.add_request(str(i), ids, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10))
    outputs = {
        name: text.tokenizer.decode(tokens, skip_special_tokens=True)
        for name, tokens in run_to_completion(engine).items()
    }
    assert [c.text for c in greedy.choices] == [outputs["greedy"]] * 4
    texts = [c.text for c in sorted(sampled.choices, key=lambda c: c.index)]
    assert texts == [outputs[str(i)] for i in range(4)]
    assert len(set(texts)) == 4
