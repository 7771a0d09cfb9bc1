"""`NativeEngineClient` over a tiny real engine: KV copies run beside the engine thread, and
a request's blocks stay pinned while a copy of them is in flight, however early its abort;
events reach the loop in order (started, then outputs)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from services.worker.native_client import NativeEngineClient
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import InvalidRequest, UnknownRequest
from shared.engine.kv_cache import KVCache
from shared.engine.kv_handoff import KVBlocks
from shared.engine.outputs import StepOutput
from shared.engine.sampling_params import SamplingParams
from shared.kvtransfer import KVLayout
from shared.protocol import SubmitRequest

PROMPT = [(7 * i) % 250 + 3 for i in range(40)]  # 3 blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []  # (event, request id)
        self.outputs: dict[str, list[int]] = {}

    def on_step(self, step: StepOutput, step_started: float) -> None:
        self.log += [("started", r) for r in step.started]
        for output in step.outputs:
            self.log.append(("output", output.request_id))
            self.outputs.setdefault(output.request_id, []).extend(output.new_token_ids)

    def on_request_failed(self, request_id: str, error: BaseException) -> None:
        self.log.append(("failed", request_id))

    def on_fatal(self, error: BaseException) -> None:
        self.log.append(("fatal", ""))


def request(request_id: str, prompt=PROMPT) -> SubmitRequest:
    return SubmitRequest(request_id, "gw", list(prompt), GREEDY, time.time() + 30)


async def wait_for(condition, timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        await asyncio.sleep(0.01)


def run(model_dir: Path, scenario) -> None:
    async def main() -> None:
        config = EngineConfig(
            model_dir=model_dir, dtype="float32", num_kv_blocks=16, model_id="tiny"
        )  # the KV blocks below are fp32
        client = NativeEngineClient(config)
        events = Events()
        layout = await client.start(events)
        try:
            await scenario(client, events, layout)
        finally:
            await client.cleanup()
            await client.cleanup()  # idempotent

    asyncio.run(main())


def test_an_abort_waits_for_the_import_in_flight(tiny_model_dir, monkeypatch):
    """The reservation's blocks are not freed (and so not handed to anyone else) while a
    write into them runs, although the abort came first."""
    writing, release = threading.Event(), threading.Event()
    real_write = KVCache.write_blocks

    def slow_write(cache, block_ids, layers, data):
        writing.set()
        assert release.wait(10)
        real_write(cache, block_ids, layers, data)

    monkeypatch.setattr(KVCache, "write_blocks", slow_write)

    async def scenario(client: NativeEngineClient, events: Events, layout: KVLayout) -> None:
        reservation = await client.kv.reserve(request("r"))
        assert len(reservation.block_ids) == 3 and reservation.num_cached_blocks == 0
        shape = (layout.num_layers, 3, *layout.block_shape)
        blocks = KVBlocks("r", 0, layout.num_layers, 0, [None] * 3, torch.zeros(shape))
        copy = asyncio.create_task(client.kv.write("r", blocks))
        await wait_for(writing.is_set)
        client.abort("r")
        await asyncio.sleep(0.3)  # steps and commands would have run by now
        assert client.stats().num_reserved == 1 and client.stats().free_blocks == 13
        release.set()
        await copy
        await wait_for(lambda: client.stats().num_reserved == 0)
        assert client.stats().free_blocks == 16
        with pytest.raises(UnknownRequest):
            await client.kv.write("r", blocks)

    run(tiny_model_dir, scenario)


def test_a_held_request_exports_in_one_copy_and_frees_on_release(tiny_model_dir):
    async def scenario(client: NativeEngineClient, events: Events, layout: KVLayout) -> None:
        await client.submit(request("h"), hold_kv=True)
        await wait_for(lambda: "h" in events.outputs)
        assert events.log[:2] == [("started", "h"), ("output", "h")]
        assert client.stats().num_held == 1
        blocks = await client.kv.export("h", first_block=1)
        assert blocks.first_block == 1 and len(blocks.block_hashes) == 2
        assert blocks.block_hashes[-1] is None  # the partly filled last block
        assert blocks.data.shape[:2] == (blocks.layer_end, 2)
        client.kv.release("h")
        await wait_for(lambda: client.stats().num_held == 0)
        assert client.stats().free_blocks == 16
        events_seen = client.take_kv_events()
        assert len(events_seen.stored) == 2 and not events_seen.removed  # 2 full blocks

    run(tiny_model_dir, scenario)


def test_check_refuses_bad_requests_and_a_failed_submit_is_reported(tiny_model_dir):
    async def scenario(client: NativeEngineClient, events: Events, layout: KVLayout) -> None:
        with pytest.raises(InvalidRequest, match="token ids must be in"):
            await client.submit(request("bad", [10**6]), hold_kv=False)
        twice = [client.submit(request("twice"), hold_kv=False) for _ in range(2)]
        await asyncio.gather(*twice)  # both checked at once; the engine refuses the second
        await wait_for(lambda: ("failed", "twice") in events.log)
        await wait_for(lambda: len(events.outputs.get("twice", [])) == GREEDY.max_tokens)

    run(tiny_model_dir, scenario)


def test_cleanup_after_a_failed_start(tmp_path):
    """A model that cannot load fails `start` with its reason; cleanup is still safe, twice."""

    async def main() -> None:
        client = NativeEngineClient(EngineConfig(model_dir=tmp_path / "missing"))
        events = Events()
        with pytest.raises(FileNotFoundError):
            await client.start(events)
        await client.cleanup()
        await client.cleanup()
        assert events.log == [("fatal", "")]

    asyncio.run(main())
