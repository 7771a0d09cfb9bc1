"""The gateway's limits over a real nats-server, with a stand-in scheduler: a body over the
limit is 413 (announced or chunked), a key past its concurrency or rate gets 429 with
Retry-After while other keys go on, and neither the prompt nor a key reaches the log."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers

from services.gateway.app import create_runner
from services.gateway.config import GatewayConfig, read_key_file
from shared.bus import Bus
from shared.config import CommonConfig
from shared.nats_server import NatsServer
from shared.ports import free_port
from shared.protocol import Outcome, SubmitAck, SubmitRequest
from shared.subjects import Subjects

NAMESPACE = "limits"
KEYS = ("sk-alpha-0123456789", "sk-beta-9876543210")
PROMPT = "hello secretword"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    vocab = {"[UNK]": 0, "hello": 1, "secretword": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


class StandInScheduler:
    """Holds every submit until `release()`, then refuses it as INVALID (a 400 at once)."""

    def __init__(self) -> None:
        self.held: list[tuple[SubmitRequest, asyncio.Future]] = []

    async def on_submit(self, request: SubmitRequest, headers) -> SubmitAck:
        answer = asyncio.get_running_loop().create_future()
        self.held.append((request, answer))
        await answer
        return SubmitAck(request.request_id, Outcome.INVALID, "stand-in")

    def release(self) -> None:
        for _, answer in self.held:
            if not answer.done():
                answer.set_result(None)


class Gateway:
    def __init__(self, loop, config: GatewayConfig, scheduler: StandInScheduler) -> None:
        self.loop, self.config, self.scheduler = loop, config, scheduler

    def call(self, key: str, body: bytes | None = None, chunked: bool = False):
        """(status, headers, JSON body) of POST /v1/completions."""
        if body is None:
            body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).encode()
        connection = http.client.HTTPConnection("127.0.0.1", self.config.port, timeout=20)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        if chunked:
            connection.request(
                "POST", "/v1/completions", iter([body]), headers, encode_chunked=True
            )
        else:
            connection.request("POST", "/v1/completions", body, headers)
        response = connection.getresponse()
        result = response.status, dict(response.headers), json.loads(response.read() or b"{}")
        connection.close()
        return result

    def held(self) -> int:
        return len(self.scheduler.held)

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.scheduler.release)


@pytest.fixture(scope="module")
def start(nats_server: NatsServer, tokenizer_dir: Path) -> Iterator:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cleanups = []

    def run(coroutine, timeout: float = 20):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)

    def start_gateway(name: str, **limits) -> Gateway:
        namespace = f"{NAMESPACE}{len(cleanups)}"
        config = GatewayConfig(
            common=CommonConfig(nats_server.url, namespace, "INFO"),
            model_dir=tokenizer_dir,
            served_model_name="tiny",
            gateway_id=name,
            max_model_len=64,
            port=free_port(),
            api_keys=KEYS,
            submit_timeout=20.0,
            **limits,
        )
        scheduler = StandInScheduler()

        async def up() -> None:
            bus = await Bus.connect(nats_server.url, "stand-in")
            await bus.serve(
                Subjects(namespace).submit,
                SubmitRequest,
                scheduler.on_submit,
                print,
                concurrent=True,
            )
            runner = create_runner(config)
            await runner.setup()
            await web.TCPSite(runner, config.host, config.port).start()
            cleanups.append((runner, bus))

        run(up())
        return Gateway(loop, config, scheduler)

    yield start_gateway
    for runner, bus in cleanups:
        run(runner.cleanup())
        run(bus.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_bodies_over_the_limit_are_413_announced_or_chunked(start) -> None:
    gateway = start("gw-body", max_body_bytes=4096)
    padded = json.dumps({"model": "tiny", "prompt": "hello " * 1000}).encode()
    for chunked in (False, True):
        status, _, body = gateway.call(KEYS[0], padded, chunked=chunked)
        assert status == 413, body
    assert gateway.held() == 0  # nothing reached the scheduler


def test_a_key_past_its_concurrency_gets_429_and_other_keys_go_on(start, caplog) -> None:
    caplog.set_level(logging.INFO)
    gateway = start("gw-conc", key_concurrency=1)
    results: list[tuple] = []
    first = threading.Thread(target=lambda: results.append(gateway.call(KEYS[0])))
    first.start()
    wait_for(lambda: gateway.held() == 1)
    status, headers, body = gateway.call(KEYS[0])
    assert status == 429 and headers["Retry-After"] == "1", body
    assert body["error"]["code"] == "concurrency_limit_exceeded"
    other = threading.Thread(target=lambda: results.append(gateway.call(KEYS[1])))
    other.start()
    wait_for(lambda: gateway.held() == 2)  # the other key is not held back
    gateway.release()
    first.join(20)
    other.join(20)
    assert [r[0] for r in results] == [400, 400]
    again = threading.Thread(target=lambda: results.append(gateway.call(KEYS[0])))
    again.start()
    wait_for(lambda: gateway.held() == 3)  # the slot came back
    gateway.release()
    again.join(20)
    assert results[-1][0] == 400
    assert "secretword" not in caplog.text
    assert not any(key in caplog.text for key in KEYS)


def test_a_key_past_its_rate_gets_429_with_retry_after(start) -> None:
    gateway = start("gw-rate", key_rate=0.2, key_burst=2)
    threads = [threading.Thread(target=gateway.call, args=(KEYS[0],)) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: gateway.held() == 2)
    status, headers, body = gateway.call(KEYS[0])
    assert status == 429, body
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert int(headers["Retry-After"]) == 5  # one token every 5 s
    other = threading.Thread(target=gateway.call, args=(KEYS[1],))
    other.start()
    wait_for(lambda: gateway.held() == 3)  # its own bucket
    gateway.release()
    for thread in [*threads, other]:
        thread.join(20)


def test_a_wrong_key_is_401_before_any_limit_and_keys_come_from_a_file(start, tmp_path) -> None:
    gateway = start("gw-auth", key_concurrency=1, key_rate=0.1, key_burst=1)
    for _ in range(3):
        assert gateway.call("sk-wrong")[0] == 401
    key_file = tmp_path / "keys"
    key_file.write_text("# team A\nsk-from-file\n\n  sk-second  \n")
    assert read_key_file(key_file) == ("sk-from-file", "sk-second")
    with pytest.raises(SystemExit, match="keys-missing"):
        read_key_file(tmp_path / "keys-missing")
