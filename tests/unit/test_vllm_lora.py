"""LoRA on a vLLM worker (services/worker/vllm_lora.py), without starting vLLM: our flags as
vLLM's engine arguments, adapter names as LoRARequests with a fresh id per load, the adapters
requests use kept, vLLM's refusals as BadAdapter (at start: a worker that cannot run)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make install ENGINE=vllm)")

from vllm.config.kv_events import KVEventsConfig

from services.worker.config import WorkerConfig
from services.worker.vllm_engine_args import engine_args
from services.worker.vllm_lora import VllmAdapters, lora_engine_args
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import BadAdapter, InvalidRequest
from shared.errors import ConfigError


def engine(**fields) -> EngineConfig:
    return EngineConfig(model_dir=Path("/m"), block_size=32, device="cpu", **fields)


class FakeLLM:
    """AsyncLLM's LoRA calls: adds what its `refuse` does not name."""

    def __init__(self, refuse: str = "") -> None:
        self.refuse = refuse
        self.loaded: dict[int, str] = {}  # id -> path

    async def add_lora(self, lora) -> bool:
        if lora.lora_name == self.refuse:
            raise ValueError(f"LoRA rank 64 is greater than max_lora_rank 16 ({lora.lora_path})")
        self.loaded[lora.lora_int_id] = lora.lora_path
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.loaded.pop(lora_id, None) is not None


def run(coro):
    return asyncio.run(coro)


def test_our_flags_become_vllms_lora_arguments():
    assert lora_engine_args(engine()) == {}
    args = lora_engine_args(engine(enable_lora=True, max_loras=3, max_lora_rank=20))
    assert args == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 3}
    assert lora_engine_args(engine(lora_modules=("a=/x",), max_cpu_loras=8))["max_cpu_loras"] == 8
    with pytest.raises(ConfigError, match="--max-lora-rank 600: vLLM serves LoRA ranks up to"):
        lora_engine_args(engine(enable_lora=True, max_lora_rank=600))
    worker = WorkerConfig(
        worker_id="p", role="both", model_name="m", engine_kind="vllm",
        engine=engine(lora_modules=("a=/x",), max_loras=2),
    )  # fmt: skip
    built = engine_args(worker, KVEventsConfig(enable_kv_cache_events=False))
    assert built.enable_lora and built.max_loras == 2 and built.max_lora_rank == 16


def test_modules_load_at_start_and_each_load_takes_a_fresh_id():
    adapters = VllmAdapters(engine(lora_modules=("a=/ad/a", "b=/ad/b")))
    llm = FakeLLM()
    run(adapters.start(llm))
    a, b = adapters.request("a"), adapters.request("b")
    assert (a.lora_int_id, a.lora_path, b.lora_int_id) == (1, "/ad/a", 2)
    assert adapters.request("") is None
    run(adapters.load(llm, "a", "/ad/a2"))  # again, at a new path: the old id goes
    assert adapters.request("a").lora_int_id == 3 and llm.loaded == {2: "/ad/b", 3: "/ad/a2"}
    assert adapters.stats()["adapters"] == ("a", "b")
    run(adapters.unload(llm, "b"))
    assert llm.loaded == {3: "/ad/a2"}
    with pytest.raises(InvalidRequest, match="no LoRA adapter 'b' is loaded"):
        adapters.request("b")


def test_an_adapter_in_use_is_neither_unloaded_nor_loaded_again():
    adapters, llm = VllmAdapters(engine(lora_modules=("a=/ad/a",))), FakeLLM()
    run(adapters.start(llm))
    adapters.started("a")
    with pytest.raises(InvalidRequest, match="serving requests"):
        run(adapters.unload(llm, "a"))
    with pytest.raises(InvalidRequest, match="serving requests"):
        run(adapters.load(llm, "a", "/ad/other"))
    adapters.ended("a")
    run(adapters.unload(llm, "a"))
    assert llm.loaded == {}


def test_vllms_refusal_is_a_bad_adapter_and_at_start_a_worker_that_cannot_run():
    adapters, llm = VllmAdapters(engine(enable_lora=True)), FakeLLM(refuse="big")
    with pytest.raises(BadAdapter, match="adapter 'big': vLLM refused it: LoRA rank 64"):
        run(adapters.load(llm, "big", "/ad/big"))
    with pytest.raises(InvalidRequest, match="adapter name"):
        run(adapters.load(llm, "no spaces", "/ad/x"))
    assert adapters.stats() == {"adapters": (), "adapters_loaded": ()}
    starting = VllmAdapters(engine(lora_modules=("big=/ad/big",)))
    with pytest.raises(ConfigError, match=r"--lora-modules big=/ad/big: .*vLLM refused it"):
        run(starting.start(llm))


def test_without_lora_adapters_are_refused_and_heartbeats_carry_none():
    adapters = VllmAdapters(engine())
    with pytest.raises(InvalidRequest, match="serves no LoRA adapters"):
        run(adapters.load(FakeLLM(), "a", "/ad/a"))
    with pytest.raises(InvalidRequest, match="no LoRA adapter 'a'"):
        adapters.request("a")
    assert adapters.stats() == {}


def test_heartbeats_name_the_adapters_used_most_recently_as_loaded():
    adapters, llm = VllmAdapters(engine(enable_lora=True, max_loras=2)), FakeLLM()
    for name in "abc":
        run(adapters.load(llm, name, f"/ad/{name}"))
    for name in "abca":
        adapters.started(name)
        adapters.ended(name)
    assert adapters.stats()["adapters_loaded"] == ("c", "a")
