"""vLLM's own sleep mode for a vLLM worker whose engine runs on a GPU.

vLLM sleeps only where its memory is CUDA's (its CPU build has none): there the engine is
built with `enable_sleep_mode` and a worker's /sleep and /wake_up become `AsyncLLM.sleep`
and `wake_up`. Level 1 offloads the weights to host memory and drops the KV cache; level 2
drops the weights too. The one subtle rule: waking from level 2 brings back the weights'
memory empty, so they are loaded again (`reload_weights`) before the KV cache comes back,
as vLLM's own server documents; and the prefix cache is reset before sleeping, so vLLM's
KV events tell the scheduler that no block of this worker is cached any more.
"""

from __future__ import annotations

from typing import Protocol

from shared.engine.errors import EngineError

NO_SLEEP_MODE = (
    "this worker's vLLM engine has no sleep mode here (vLLM's sleep needs CUDA, ROCm or XPU "
    "memory; its CPU build has none)"
)


class SleepingEngine(Protocol):
    """What of vLLM's `AsyncLLM` sleeping uses."""

    async def reset_prefix_cache(self) -> bool: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> bool: ...

    async def collective_rpc(self, method: str) -> object: ...


def sleep_mode_available(device_type: str) -> bool:
    """Whether vLLM can sleep on this device (its engine is then built with sleep mode)."""
    return device_type == "cuda"


class VllmSleep:
    """Puts one vLLM engine to sleep and wakes it, remembering the level it slept at."""

    def __init__(self, device_type: str) -> None:
        self.available = sleep_mode_available(device_type)
        self.level = 0  # 0: awake

    async def sleep(self, llm: SleepingEngine | None, level: int) -> None:
        if not self.available:
            raise EngineError(NO_SLEEP_MODE)
        if llm is None:
            raise EngineError("the vLLM engine has not started")
        if self.level:
            return
        await llm.reset_prefix_cache()
        await llm.sleep(level)
        self.level = level

    async def wake_up(self, llm: SleepingEngine | None) -> None:
        if not self.level or llm is None:
            return
        if self.level >= 2:
            await llm.wake_up(["weights"])
            await llm.collective_rpc("reload_weights")
            await llm.wake_up(["kv_cache"])
        else:
            await llm.wake_up()
        self.level = 0
