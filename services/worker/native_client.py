"""`NativeEngineClient`: the `EngineClient` of our own engine (shared/engine) in its thread.

Commands that change the engine run in the engine thread between steps (engine_thread.py);
each step's `StepOutput` (outputs, requests started, requests held with their blocks) comes
back to the loop as it is. The engine's thread-safe parts — its request checker and its
KV hand-off (native_kv.py) — are taken once at start, so nothing else reaches into the
engine from outside its thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from services.worker.core_lease import CoreLease
from services.worker.engine_client import EngineEvents
from services.worker.engine_thread import EngineThread
from services.worker.native_kv import NativeKV
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import InvalidRequest
from shared.engine.kv_handoff import KVHandOff
from shared.engine.outputs import StepOutput
from shared.engine.request_check import RequestChecker
from shared.engine.startup_phases import StartupPhase
from shared.engine.stats import EngineStats, KVCacheEvents
from shared.kvtransfer import KVLayout
from shared.protocol import SubmitRequest


class NativeEngineClient:
    def __init__(self, config: EngineConfig, role: str = "both") -> None:
        self.config = config
        self._events: EngineEvents | None = None
        # No thread count given: share the machine's cores with its other workers.
        shares_cores = config.num_threads is None and config.torch_device.type == "cpu"
        lease = CoreLease(role=role) if shares_cores else None
        self._thread = EngineThread(lambda: LLMEngine(config), self._on_step, self._on_fatal, lease)
        self._checker: RequestChecker | None = None
        self._kv: NativeKV | None = None
        self._startup: dict[StartupPhase, float] = {}

    @property
    def kv(self) -> NativeKV:
        assert self._kv is not None, "start() first"
        return self._kv

    async def start(self, events: EngineEvents) -> KVLayout:
        self._events = events
        await self._thread.start()
        self._checker, handoff, layout = await self._thread.call(_thread_safe_parts)
        self._startup = await self._thread.call(lambda engine: dict(engine.startup.seconds))
        self._kv = NativeKV(self._thread, handoff, self._request_failed)
        return layout

    def startup_phases(self) -> dict[StartupPhase, float]:
        return self._startup

    async def submit(self, request: SubmitRequest, *, hold_kv: bool) -> None:
        checker = self._checker
        assert checker is not None, "start() first"
        adapter, stats = request.sampling.adapter, self._thread.stats
        if adapter and (stats is None or adapter not in stats.adapters):
            raise InvalidRequest("model", f"no LoRA adapter {adapter!r} is loaded")
        await asyncio.to_thread(
            checker.check, request.prompt_token_ids, request.sampling, request.delivered_token_ids
        )
        self._post(
            request.request_id,
            lambda engine: engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                output_token_ids=request.delivered_token_ids,
                hold_kv=hold_kv,
            ),
        )

    async def load_adapter(self, name: str, path: str) -> None:
        await self._thread.call(lambda engine: engine.load_adapter(name, Path(path)))

    async def unload_adapter(self, name: str) -> None:
        await self._thread.call(lambda engine: engine.unload_adapter(name))

    def abort(self, request_id: str) -> None:
        self.kv.let_go(request_id, lambda engine: engine.abort_request(request_id))

    def stats(self) -> EngineStats:
        stats = self._thread.stats
        assert stats is not None, "start() first"
        return replace(stats, costs=self._thread.timer.current)

    def take_kv_events(self) -> KVCacheEvents:
        return self._thread.take_kv_events()

    async def sleep(self, level: int) -> None:
        await self._thread.call(lambda engine: engine.sleep(level))

    async def wake_up(self) -> None:
        await self._thread.call(lambda engine: engine.wake_up())

    async def drain(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while self._thread.alive and loop.time() < give_up:
            stats = self._thread.stats
            if stats is None or not (
                stats.num_running or stats.num_waiting or stats.num_held or stats.num_reserved
            ):
                return True
            await asyncio.sleep(0.02)
        return not self._thread.alive

    async def cleanup(self) -> None:
        await self._thread.stop()
        if self._kv is not None:
            self._kv.close()

    # -- internals ------------------------------------------------------------------------------
    def _post(self, request_id: str, fn: Callable[[LLMEngine], object]) -> None:
        self._thread.post(fn, lambda exc: self._request_failed(request_id, exc))

    def _request_failed(self, request_id: str, exc: BaseException) -> None:
        if self._events is not None:
            self._events.on_request_failed(request_id, exc)

    def _on_step(self, step: StepOutput, step_started: float) -> None:
        if self._events is not None:
            self._events.on_step(step, step_started)

    def _on_fatal(self, exc: BaseException) -> None:
        if self._events is not None:
            self._events.on_fatal(exc)


def _thread_safe_parts(engine: LLMEngine) -> tuple[RequestChecker, KVHandOff, KVLayout]:
    """What of the engine any thread may use (its checker, its KV hand-off), and its layout."""
    model = engine.model_config
    layout = KVLayout(
        num_layers=model.num_layers,
        block_size=engine.config.block_size,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=engine.config.dtype,
    )
    return engine.checker, engine.kv, layout
