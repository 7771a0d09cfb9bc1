"""The typed boundary between a worker's NATS runtime and the engine it runs.

`EngineClient` is what the runtime calls (the shape of NVIDIA Dynamo's engine interface:
start / submit / abort / export_kv / import_kv / stats / drain / cleanup); `EngineEvents` is
what the engine calls back, on the event loop. The native engine implements the client in
native_client.py; a vLLM engine implements the same one. Nothing above this file knows
which engine runs.

The promises every implementation keeps:
- Nothing here waits for an engine step in progress, except `reserve` (it needs block ids;
  a decode worker's steps are short). `check` is the admission test and never queues.
- `submit`, `abort`, `start_decode` and `release` are queued and return at once; a failure
  of a queued command arrives as `on_request_failed`.
- `export_kv` and `import_kv` copy blocks beside the running steps; the blocks of a request
  stay pinned until its copies are done, however soon `abort` or `release` is called.
- Errors are `shared.engine.errors`: `InvalidRequest` (the request is bad), `OutOfBlocks`
  (no room now), `UnknownRequest`; anything else is an internal error.
- `cleanup` is idempotent and safe after a failed `start`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.engine.kv_handoff import KVBlocks
from shared.engine.outputs import RequestOutput
from shared.engine.stats import EngineStats, KVCacheEvents
from shared.kvtransfer import KVLayout
from shared.protocol import SubmitRequest


@dataclass(frozen=True, slots=True)
class KVReservation:
    """Blocks a decode engine holds for a prompt."""

    block_ids: list[int]  # for the whole prompt, in order
    num_cached_blocks: int  # leading blocks already in its prefix cache: not to be sent


class EngineEvents(Protocol):
    """Called on the event loop; `step_started` is a step's start in Unix seconds."""

    def on_started(self, request_ids: list[str], step_started: float) -> None:
        """These requests' first chunks were computed in the step that began then."""

    def on_outputs(self, outputs: list[RequestOutput], step_started: float) -> None:
        """New tokens (and finishes) of one step."""

    def on_request_failed(self, request_id: str, error: BaseException) -> None:
        """A queued command for this request failed in the engine."""

    def on_fatal(self, error: BaseException) -> None:
        """The engine stopped for good; every request it held is lost."""


class EngineClient(Protocol):
    async def start(self, events: EngineEvents) -> KVLayout:
        """Load the model and start serving; the layout of its KV cache."""

    async def check(self, request: SubmitRequest) -> None:
        """Raise `InvalidRequest` if the engine would refuse the request (no step waits)."""

    def submit(self, request: SubmitRequest, *, hold_kv: bool) -> None:
        """Queue the request (resumed after its delivered tokens). `hold_kv`: stop after the
        first token and keep its KV blocks for `export_kv` until `release`."""

    def abort(self, request_id: str) -> None:
        """Forget the request and free its blocks, whatever state it is in."""

    async def reserve(self, request: SubmitRequest) -> KVReservation:
        """Hold blocks for the request's prompt and delivered tokens."""

    async def import_kv(self, request_id: str, blocks: KVBlocks) -> None:
        """Write received blocks into a reservation (checked against it first)."""

    def reserved_blocks(
        self, request_id: str, first_block: int, block_hashes: list[int | None]
    ) -> list[int]:
        """The reservation's block ids from `first_block` on, one per hash, after checking
        each full block's hash against the prompt (InvalidRequest)."""

    def pinned(self, request_id: str) -> AbstractAsyncContextManager[None]:
        """Keep the request's blocks (held or reserved) from being freed while the body runs
        (a transport READs or is READ from them); an abort meanwhile waits for its end."""

    def kv_cache_layers(self) -> list[torch.Tensor]:
        """The paged KV cache a transport registers: one tensor per layer, never moved."""

    def start_decode(
        self, request_id: str, first_token_id: int, engine_params: bytes = b""
    ) -> None:
        """Every block is in: append the first token, join the running batch. `engine_params`:
        the prefill engine's `hand_off_params` (vLLM's engine READs the blocks with them)."""

    async def export_kv(self, request_id: str, first_block: int) -> KVBlocks:
        """A held request's blocks from `first_block` on, every layer, in one copy."""

    def held_blocks(self, request_id: str) -> tuple[list[int], list[int | None]]:
        """A held request's blocks: (ids, hash per block; None for a partly filled one)."""

    def hand_off_params(self, request_id: str) -> bytes:
        """What the decode engine needs besides the held request's blocks (b"": nothing)."""

    def release(self, request_id: str) -> None:
        """The held request's KV is shipped: free its blocks."""

    def stats(self) -> EngineStats:
        """The latest counters (never waits)."""

    def take_kv_events(self) -> KVCacheEvents:
        """Prefix-cache blocks stored and removed since the last call."""

    async def drain(self, timeout: float) -> bool:
        """Wait until the engine holds no request; False when `timeout` passed first."""

    async def cleanup(self) -> None:
        """Stop the engine and free what it holds."""
