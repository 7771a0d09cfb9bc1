"""`NativeEngineClient`: the `EngineClient` of our own engine (shared/engine) in its thread.

Commands that change the engine run in the engine thread between steps (engine_thread.py).
KV copies do not: a held request's blocks and a reservation's blocks belong to no running
sequence, so `export_kv` and `import_kv` copy them in a small thread pool while steps go
on. Each request's blocks stay pinned while a copy of them is in flight: its `abort` or
`release` is queued only when the last copy is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from services.worker.core_lease import CoreLease
from services.worker.engine_client import EngineEvents, KVReservation
from services.worker.engine_thread import EngineThread, StepReport
from shared.engine.block_hash import hash_full_blocks
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import UnknownRequest
from shared.engine.kv_handoff import KVBlocks, check_offered
from shared.engine.outputs import RequestOutput
from shared.engine.stats import EngineStats, KVCacheEvents
from shared.kvtransfer import KVLayout
from shared.protocol import SubmitRequest

T = TypeVar("T")
KV_COPY_THREADS = 2


@dataclass(slots=True)
class _Pinned:
    """The blocks of a held request or a reservation, as the KV copies need them."""

    block_ids: list[int]
    block_hashes: list[int | None]  # held: per block, None for a partly filled one
    copies: int = 0  # in flight
    after: list[Callable[[], None]] = field(default_factory=list)  # once copies reach 0


class NativeEngineClient:
    def __init__(self, config: EngineConfig, role: str = "both") -> None:
        self.config = config
        self._events: EngineEvents | None = None
        # No thread count given: share the machine's cores with its other workers.
        shares_cores = config.num_threads is None and config.torch_device.type == "cpu"
        lease = CoreLease(role=role) if shares_cores else None
        self._thread = EngineThread(lambda: LLMEngine(config), self._on_step, self._on_fatal, lease)
        self._copier = ThreadPoolExecutor(KV_COPY_THREADS, thread_name_prefix="kv-copy")
        self._pinned: dict[str, _Pinned] = {}
        self._layout: KVLayout | None = None
        # Engine thread only: requests not yet scheduled, and those that will be held.
        self._unstarted: set[str] = set()
        self._holding: set[str] = set()
        self._engine: LLMEngine | None = None  # for `check` only: thread-safe (see engine)

    async def start(self, events: EngineEvents) -> KVLayout:
        self._events = events
        await self._thread.start()
        self._layout = await self._thread.call(_layout)
        self._engine = await self._thread.call(lambda engine: engine)
        return self._layout

    async def check(self, request: SubmitRequest) -> None:
        engine = self._engine
        assert engine is not None, "start() first"
        await asyncio.to_thread(
            engine.check_request,
            request.prompt_token_ids,
            request.sampling,
            request.delivered_token_ids,
        )

    def submit(self, request: SubmitRequest, *, hold_kv: bool) -> None:
        def add(engine: LLMEngine) -> None:
            engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                output_token_ids=request.delivered_token_ids,
                hold_kv=hold_kv,
            )
            self._unstarted.add(request.request_id)
            if hold_kv:
                self._holding.add(request.request_id)

        self._post(request.request_id, add)

    def abort(self, request_id: str) -> None:
        def abort(engine: LLMEngine) -> None:
            engine.abort_request(request_id)
            self._unstarted.discard(request_id)
            self._holding.discard(request_id)

        self._after_copies(request_id, lambda: self._post(request_id, abort))

    async def reserve(self, request: SubmitRequest) -> KVReservation:
        tokens = [*request.prompt_token_ids, *request.delivered_token_ids]
        reservation = await self._thread.call(
            lambda engine: engine.reserve(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                output_token_ids=request.delivered_token_ids,
            )
        )
        hashes = hash_full_blocks(tokens, self.config.block_size, self.config.model_id)
        self._pinned[request.request_id] = _Pinned(reservation.block_ids, list(hashes))
        return KVReservation(reservation.block_ids, reservation.num_cached_blocks)

    async def import_kv(self, request_id: str, blocks: KVBlocks) -> None:
        block_ids = self.reserved_blocks(request_id, blocks.first_block, blocks.block_hashes)
        engine = self._engine
        assert engine is not None
        await self._copy(request_id, engine.write_blocks, block_ids, blocks.layers, blocks.data)

    def reserved_blocks(
        self, request_id: str, first_block: int, block_hashes: list[int | None]
    ) -> list[int]:
        pinned = self._pin(request_id)
        indices = check_offered(
            request_id, len(pinned.block_ids), pinned.block_hashes, first_block, block_hashes
        )
        return pinned.block_ids[indices.start : indices.stop]

    def held_blocks(self, request_id: str) -> tuple[list[int], list[int | None]]:
        pinned = self._pin(request_id)
        return list(pinned.block_ids), list(pinned.block_hashes)

    @contextlib.asynccontextmanager
    async def pinned(self, request_id: str) -> AsyncIterator[None]:
        pinned = self._pin(request_id)
        pinned.copies += 1
        try:
            yield
        finally:
            self._copy_done(pinned)

    def kv_cache_layers(self) -> list[torch.Tensor]:
        engine = self._engine
        assert engine is not None, "start() first"
        return engine.kv_cache_layers()

    def start_decode(
        self, request_id: str, first_token_id: int, engine_params: bytes = b""
    ) -> None:
        def start(engine: LLMEngine) -> None:
            output = engine.start_decode(request_id, first_token_id)
            if output.finish_reason is not None:  # the first token ended it: say so
                output.new_token_ids, output.new_logprobs = [], []
                self._loop_call(self._finished_at_start, output)

        self._pinned.pop(request_id, None)  # no copy is in flight: KVDone follows the last
        self._post(request_id, start)

    async def export_kv(self, request_id: str, first_block: int) -> KVBlocks:
        pinned = self._pin(request_id)
        layout = self._layout
        engine = self._engine
        assert layout is not None and engine is not None
        layers = range(layout.num_layers)
        block_ids = pinned.block_ids[first_block:]
        data = await self._copy(request_id, engine.read_blocks, block_ids, layers)
        return KVBlocks(
            request_id=request_id,
            layer_start=layers.start,
            layer_end=layers.stop,
            first_block=first_block,
            block_hashes=pinned.block_hashes[first_block:],
            data=data,
        )

    def hand_off_params(self, request_id: str) -> bytes:
        return b""  # the blocks are all a native decode engine needs

    def release(self, request_id: str) -> None:
        def release(engine: LLMEngine) -> None:
            engine.release(request_id)

        self._after_copies(request_id, lambda: self._post(request_id, release))

    def stats(self) -> EngineStats:
        stats = self._thread.stats
        assert stats is not None, "start() first"
        return stats

    def take_kv_events(self) -> KVCacheEvents:
        return self._thread.take_kv_events()

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
        self._copier.shutdown(wait=True)
        self._pinned.clear()

    # -- internals (the loop's side) ----------------------------------------------------------
    def _post(self, request_id: str, fn: Callable[[LLMEngine], None]) -> None:
        self._thread.post(fn, lambda exc: self._request_failed(request_id, exc))

    def _request_failed(self, request_id: str, exc: BaseException) -> None:
        if self._events is not None:
            self._events.on_request_failed(request_id, exc)

    def _pin(self, request_id: str) -> _Pinned:
        pinned = self._pinned.get(request_id)
        if pinned is None:
            raise UnknownRequest(f"request {request_id!r} holds no blocks here")
        return pinned

    async def _copy(self, request_id: str, fn: Callable[..., T], *args: Any) -> T:
        """Run a KV copy in the pool; the request's blocks stay pinned until it is done, even
        if the caller is cancelled meanwhile (the copy itself cannot be stopped)."""
        pinned = self._pin(request_id)
        pinned.copies += 1
        future = asyncio.get_running_loop().run_in_executor(self._copier, fn, *args)
        future.add_done_callback(lambda _: self._copy_done(pinned))
        return await asyncio.shield(future)

    def _copy_done(self, pinned: _Pinned) -> None:
        pinned.copies -= 1
        if not pinned.copies:
            after, pinned.after = pinned.after, []
            for command in after:
                command()

    def _after_copies(self, request_id: str, command: Callable[[], None]) -> None:
        """Run `command` once no copy of the request's blocks is in flight; unpin them."""
        pinned = self._pinned.pop(request_id, None)
        if pinned is not None and pinned.copies:
            pinned.after.append(command)
        else:
            command()

    def _loop_call(self, fn: Callable[..., None], *args: Any) -> None:
        self._thread.to_loop(fn, *args)

    def _finished_at_start(self, output: RequestOutput) -> None:
        if self._events is not None:
            self._events.on_outputs([output], time.time())

    def _on_fatal(self, exc: BaseException) -> None:
        if self._events is not None:
            self._events.on_fatal(exc)

    # -- internals (the engine thread's side) ---------------------------------------------------
    def _on_step(self, engine: LLMEngine, report: StepReport) -> None:
        report.started = [r for r in self._unstarted if engine.is_started(r)]
        self._unstarted.difference_update(report.started)
        held: dict[str, _Pinned] = {}
        for output in report.outputs:
            request_id = output.request_id
            if request_id not in self._holding:
                continue
            self._holding.discard(request_id)
            if output.finish_reason is None:
                block_ids, block_hashes = engine.held_blocks(request_id)
                held[request_id] = _Pinned(block_ids, block_hashes)
        self._loop_call(self._deliver, report, held)

    def _deliver(self, report: StepReport, held: dict[str, _Pinned]) -> None:
        self._pinned.update(held)
        if self._events is None:
            return
        if report.started:
            self._events.on_started(report.started, report.step_started)
        if report.outputs:
            self._events.on_outputs(report.outputs, report.step_started)


def _layout(engine: LLMEngine) -> KVLayout:
    model = engine.model_config
    return KVLayout(
        num_layers=model.num_layers,
        block_size=engine.config.block_size,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=engine.config.dtype,
    )
