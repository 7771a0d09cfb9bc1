"""vLLM's sleep mode as a worker drives it: refused on a CPU, the calls vLLM documents on a
GPU (level 2 reloads the weights before the KV cache comes back), and the engine built with
sleep mode only where it has one. vLLM itself is faked: its sleep needs CUDA."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.vllm_sleep import VllmSleep, sleep_mode_available
from shared.engine.errors import EngineError


class FakeLLM:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return True

    async def collective_rpc(self, method: str) -> object:
        self.calls.append(("rpc", method))
        return None


def test_a_cpu_engine_refuses_to_sleep_and_calls_nothing():
    llm, sleeping = FakeLLM(), VllmSleep("cpu")
    with pytest.raises(EngineError, match="no sleep mode"):
        asyncio.run(sleeping.sleep(llm, 1))
    asyncio.run(sleeping.wake_up(llm))
    assert llm.calls == [] and sleeping.level == 0


def test_level_1_forgets_the_prefix_cache_then_sleeps_and_wakes_whole():
    llm, sleeping = FakeLLM(), VllmSleep("cuda")
    asyncio.run(sleeping.sleep(llm, 1))
    asyncio.run(sleeping.sleep(llm, 1))  # asleep already: nothing more
    assert sleeping.level == 1
    asyncio.run(sleeping.wake_up(llm))
    asyncio.run(sleeping.wake_up(llm))  # awake already: nothing more
    assert llm.calls == [("reset_prefix_cache",), ("sleep", 1), ("wake_up", None)]
    assert sleeping.level == 0


def test_waking_from_level_2_reloads_the_weights_before_the_kv_cache_returns():
    llm, sleeping = FakeLLM(), VllmSleep("cuda")
    asyncio.run(sleeping.sleep(llm, 2))
    asyncio.run(sleeping.wake_up(llm))
    assert llm.calls[2:] == [
        ("wake_up", ["weights"]),
        ("rpc", "reload_weights"),
        ("wake_up", ["kv_cache"]),
    ]


def test_an_engine_not_started_is_refused_not_asserted():
    with pytest.raises(EngineError, match="not started"):
        asyncio.run(VllmSleep("cuda").sleep(None, 1))


def test_sleep_mode_is_asked_of_vllm_on_a_gpu_only():
    assert sleep_mode_available("cuda") and not sleep_mode_available("cpu")
