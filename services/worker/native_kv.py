"""`NativeKV`: the `EngineKV` of our own engine, over the engine's `KVHandOff`.

The hand-off is thread-safe and owns the pins, so the copies run in a small thread pool
beside the engine's steps (a held request's blocks and a reservation's belong to no running
sequence), while what changes the engine (reserve, release, start_decode, abort) is queued
to the engine thread. The one subtle rule: a request is let go of by `KVHandOff.unpin`
only, whose command reaches the engine thread once the last copy of its blocks is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from services.worker.engine_thread import EngineThread
from shared.engine.engine import LLMEngine
from shared.engine.kv_handoff import KVBlocks, KVHandOff, Reservation
from shared.engine.kv_tier.peer import PeerTake, adopt_read, take_for_peer
from shared.kvtransfer.transfer import KVCopier
from shared.protocol import SubmitRequest

log = logging.getLogger(__name__)
T = TypeVar("T")
KV_COPY_THREADS = 2
Failed = Callable[[str, BaseException], None]  # (request id, why): a queued command failed


class NativeKV:
    def __init__(self, thread: EngineThread, handoff: KVHandOff, on_failed: Failed) -> None:
        self._thread = thread
        self._handoff = handoff
        self._on_failed = on_failed
        self._copies = ThreadPoolExecutor(KV_COPY_THREADS, thread_name_prefix="kv-copy")

    @property
    def copier(self) -> KVCopier:
        return self

    def cache_layers(self) -> list[torch.Tensor]:
        return self._handoff.layers()

    @property
    def peer_blocks(self) -> NativeKV:
        return self

    # -- PeerBlocks: prefix blocks read by or from another worker ----------------------------
    async def pin_cached(self, hashes: list[int]) -> list[int]:
        return await self._thread.call(lambda engine: engine.block_manager.pin_cached(hashes))

    def unpin(self, block_ids: list[int]) -> None:
        self._thread.post(lambda engine: engine.block_manager.unpin(block_ids), _log_failure)

    async def take_for_peer(self, request: SubmitRequest, end_block: int) -> PeerTake | None:
        tokens = request.prompt_token_ids + request.delivered_token_ids
        adapter = request.sampling.adapter
        return await self._thread.call(
            lambda engine: take_for_peer(engine.block_manager, tokens, adapter, end_block)
        )

    def adopt(self, take: PeerTake, num_read: int) -> None:
        self._thread.post(
            lambda engine: adopt_read(engine.block_manager, take, num_read), _log_failure
        )

    async def reserve(self, request: SubmitRequest) -> Reservation:
        return await self._thread.call(
            lambda engine: engine.reserve(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                output_token_ids=request.delivered_token_ids,
            )
        )

    def reserved(
        self, request_id: str, first_block: int, block_hashes: list[int | None]
    ) -> list[int]:
        return self._handoff.reserved(request_id, first_block, block_hashes)

    def params(self, request_id: str) -> bytes:
        return b""  # the blocks are all a native decode engine needs

    @contextlib.asynccontextmanager
    async def pinned(self, request_id: str) -> AsyncIterator[None]:
        with self._handoff.pinned(request_id):
            yield

    def release(self, request_id: str) -> None:
        self.let_go(request_id, lambda engine: engine.release(request_id))

    def start_decode(self, request_id: str, first_token_id: int, engine_params: bytes) -> None:
        self.let_go(request_id, lambda engine: engine.start_decode(request_id, first_token_id))

    async def export(self, request_id: str, first_block: int) -> KVBlocks:
        return await self._copy(self._handoff.export, request_id, first_block)

    async def write(self, request_id: str, blocks: KVBlocks) -> None:
        await self._copy(self._handoff.write, request_id, blocks)

    def let_go(self, request_id: str, command: Callable[[LLMEngine], object]) -> None:
        """Unpin the request, then queue `command` for the engine thread once no copy of its
        blocks is in flight."""

        def post() -> None:
            self._thread.post(command, lambda exc: self._on_failed(request_id, exc))

        self._handoff.unpin(request_id, post)

    def close(self) -> None:
        self._copies.shutdown(wait=True)

    async def _copy(self, fn: Callable[..., T], *args: object) -> T:
        """Run a copy in the pool; the hand-off pins the blocks until it is done, even if
        the caller is cancelled meanwhile (the copy itself cannot be stopped)."""
        return await asyncio.get_running_loop().run_in_executor(self._copies, fn, *args)


def _log_failure(exc: BaseException) -> None:
    log.error("a command on prefix blocks read between workers failed: %r", exc)
