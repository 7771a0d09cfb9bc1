"""The typed boundary between a worker's NATS runtime and the engine it runs.

`EngineClient` is what the runtime calls (the shape of NVIDIA Dynamo's engine interface:
start / submit / abort / drain / cleanup, plus stats), and `kv`, the engine's side of the
KV hand-off (`EngineKV`); `EngineEvents` is what the engine calls back, on the event loop,
once per step: its outputs and its own transitions (started, held). The native engine
implements the client in native_client.py, vLLM's in vllm_client.py; both implement all of
it. Nothing above this file knows which engine runs.

The promises every implementation keeps:
- Nothing here waits for an engine step in progress, except `kv.reserve` (it needs block
  ids; a decode worker's steps are short). `submit` checks the request without queueing.
- `abort`, `kv.release` and `kv.start_decode` are queued and return at once; a failure of a
  queued command arrives as `on_request_failed`.
- Blocks being handed off stay pinned while a copy or READ of them runs, however soon
  `abort` or `kv.release` is called.
- Errors are `shared.engine.errors`: `InvalidRequest` (the request is bad), `OutOfBlocks`
  (no room now), `UnknownRequest`; anything else is an internal error.
- `cleanup` is idempotent and safe after a failed `start`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

import torch

from shared.engine.kv_handoff import Reservation
from shared.engine.kv_tier.peer import PeerTake
from shared.engine.outputs import StepOutput
from shared.engine.startup_phases import StartupPhase
from shared.engine.stats import EngineStats, KVCacheEvents
from shared.kvtransfer import KVLayout
from shared.kvtransfer.transfer import KVCopier
from shared.protocol import SubmitRequest


class EngineEvents(Protocol):
    """Called on the event loop; `step_started` is a step's start in Unix seconds."""

    def on_step(self, step: StepOutput, step_started: float) -> None:
        """What one step did: requests started, tokens (and finishes), requests held."""

    def on_request_failed(self, request_id: str, error: BaseException) -> None:
        """A queued command for this request failed in the engine."""

    def on_fatal(self, error: BaseException) -> None:
        """The engine stopped for good; every request it held is lost."""


class PeerBlocks(Protocol):
    """The engine's pool as reads of prefix blocks between workers need it
    (shared/engine/kv_tier/peer.py); the commands that free blocks are queued."""

    async def pin_cached(self, hashes: list[int]) -> list[int]:
        """Holder: pin the leading run of `hashes` the pool caches; their block ids."""

    def unpin(self, block_ids: list[int]) -> None:
        """Holder: the READ is over (or its time is): let go of the blocks."""

    async def take_for_peer(self, request: SubmitRequest, end_block: int) -> PeerTake | None:
        """Reader: fresh blocks for the prompt's blocks it lacks, up to `end_block`."""

    def adopt(self, take: PeerTake, num_read: int) -> None:
        """Reader: the first `num_read` blocks were READ: cache them; free the rest."""


class EngineKV(Protocol):
    """The engine's side of the KV hand-off: a prefill engine's held blocks, a decode
    engine's reservations."""

    @property
    def copier(self) -> KVCopier | None:
        """Block copies, for the `nats` transport; None: this engine moves KV only through
        its one-sided transport."""

    def cache_layers(self) -> list[torch.Tensor]:
        """The paged KV cache a transport registers: one tensor per layer, never moved."""

    @property
    def peer_blocks(self) -> PeerBlocks | None:
        """Its pool for prefix reads between workers; None: this engine takes part in none."""

    async def reserve(self, request: SubmitRequest) -> Reservation:
        """Hold blocks for the request's prompt and delivered tokens."""

    def reserved(
        self, request_id: str, first_block: int, block_hashes: list[int | None]
    ) -> list[int]:
        """The reservation's block ids from `first_block` on, one per hash, after checking
        each full block's hash against the prompt (InvalidRequest)."""

    def params(self, request_id: str) -> bytes:
        """What the decode engine needs besides the held request's blocks (b"": nothing)."""

    def pinned(self, request_id: str) -> AbstractAsyncContextManager[None]:
        """Keep the request's blocks (held or reserved) while the body runs (a transport
        READs or is READ from them); an abort meanwhile waits for its end."""

    def release(self, request_id: str) -> None:
        """The held request's KV is shipped: free its blocks."""

    def start_decode(self, request_id: str, first_token_id: int, engine_params: bytes) -> None:
        """Every block is in: append the first token, join the running batch. `engine_params`:
        the prefill engine's `params` (vLLM's engine READs the blocks with them)."""


class EngineClient(Protocol):
    @property
    def kv(self) -> EngineKV:
        """The KV hand-off (after `start`)."""

    async def start(self, events: EngineEvents) -> KVLayout:
        """Load the model and start serving; the layout of its KV cache."""

    def startup_phases(self) -> dict[StartupPhase, float]:
        """Seconds of the phases of `start` the engine timed itself (after `start`)."""

    async def submit(self, request: SubmitRequest, *, hold_kv: bool) -> None:
        """Check the request (InvalidRequest; no step waits) and queue it, resumed after its
        delivered tokens. `hold_kv`: stop after the first token and keep its KV blocks
        (reported in the step's `held`) until `kv.release`."""

    def abort(self, request_id: str) -> None:
        """Forget the request and free its blocks, whatever state it is in."""

    def stats(self) -> EngineStats:
        """The latest counters (never waits)."""

    def take_kv_events(self) -> KVCacheEvents:
        """Prefix-cache blocks stored and removed since the last call."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Read, check and serve a LoRA adapter as `name` (shared/engine/lora/): BadAdapter
        or InvalidRequest saying why not; the engine serves on either way."""

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (InvalidRequest while requests use it)."""

    async def sleep(self, level: int) -> None:
        """Give back the KV pool (level 1) and the weights too (level 2); only while it holds
        no request (an error otherwise, or where the engine has no sleep mode)."""

    async def wake_up(self) -> None:
        """Bring back what `sleep` gave back."""

    async def drain(self, timeout: float) -> bool:
        """Wait until the engine holds no request; False when `timeout` passed first."""

    async def cleanup(self) -> None:
        """Stop the engine and free what it holds."""
