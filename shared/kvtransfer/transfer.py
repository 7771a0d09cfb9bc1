"""The one-sided KV transport: a decode worker READs the blocks it lacks straight out of the
prefill worker's registered KV cache into its own reserved blocks.

Every worker makes one `KVTransport` at start over its paged cache (one tensor per layer,
[num_blocks, block_size, 2, kv_heads, head_dim], on the CPU or a GPU) and publishes its
`metadata()` in the mesh's own messages (`KVReady`), never through a side channel. A
decode worker `connect`s to a peer once (by agent name), then each transfer is one
`start_read` whose handle it polls until SUCCESS or FAILED, within a deadline.

| state | meaning |
|---|---|
| BOOTSTRAPPING | the peer's metadata is being loaded |
| WAITING_FOR_INPUT | nothing asked yet |
| TRANSFERRING | the READ is in flight: the local blocks must stay reserved |
| SUCCESS | every byte is in the local blocks |
| FAILED | nothing can be trusted in the local blocks; `error` says why |

Implementations: `nixl` (NIXL over UCX; nixl_transport.py) and `fake` (an in-process copy,
for tests; fake_transport.py). The `nats` transport (nats_transport.py) pushes chunks
instead and does not take this shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

from shared.kvtransfer.chunks import KVLayout

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
POLL_S = 0.0005  # between polls of a READ in flight (64 blocks take ~10 ms at 4 GB/s)


class TransferState(IntEnum):
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4


class TransportUnavailable(RuntimeError):
    """This transport cannot run here (library missing, no usable UCX transport, ...)."""


class ReadHandle(Protocol):
    def poll(self) -> TransferState:
        """Where the READ is; never blocks."""

    @property
    def error(self) -> str:
        """Why it FAILED ("" otherwise)."""

    def release(self) -> None:
        """Free the handle (after SUCCESS or FAILED; aborts a READ still in flight where the
        library can, and says so by raising when it cannot)."""


class KVTransport(Protocol):
    name: str  # "nixl" | "fake"
    layout: KVLayout  # of this worker's own registered cache (a peer's must be equal)
    num_blocks: int  # its block ids are in [0, num_blocks)

    def metadata(self) -> bytes:
        """What a peer needs to `connect` to this worker (opaque)."""

    def connect(self, peer: str, metadata: bytes, num_blocks: int) -> None:
        """Know `peer` (idempotent), whose cache holds `num_blocks` blocks."""

    def start_read(
        self, peer: str, remote_blocks: list[int], local_blocks: list[int]
    ) -> ReadHandle:
        """READ every layer of `remote_blocks` of `peer`'s cache into `local_blocks` of this
        worker's (same length, same order). Ids are checked against both caches first
        (ValueError, before any byte moves)."""

    def serving(self) -> AbstractContextManager[None]:
        """While the body runs a peer may READ from this cache: keep this side answering."""

    def close(self) -> None:
        """Deregister the cache and stop the agent."""


# (agent name, the cache's layer tensors, its layout, wanted: auto | nixl | nats) → the
# worker's one-sided transport, or None when KV is to move over NATS.
TransportFactory = Callable[[str, list["torch.Tensor"], KVLayout, str], KVTransport | None]


class TransferError(RuntimeError):
    """A KV transfer that cannot complete (a refused chunk, a failed READ, a deadline):
    the receiving blocks hold nothing usable."""


async def read_blocks(
    transport: KVTransport,
    peer: str,
    remote_blocks: list[int],
    local_blocks: list[int],
    deadline: float,
) -> None:
    """One READ, polled on the event loop until it is over; `deadline` on the loop's clock.
    The handle is released whatever happens (cancelled too); one that cannot be aborted
    is waited out, since its bytes would land in blocks someone else may own by then."""
    loop = asyncio.get_running_loop()
    handle = transport.start_read(peer, remote_blocks, local_blocks)
    try:
        while (state := handle.poll()) == TransferState.TRANSFERRING:
            if loop.time() > deadline:
                blocks = len(local_blocks)
                raise TransferError(f"READ of {blocks} blocks from {peer} passed its deadline")
            await asyncio.sleep(POLL_S)
        if state != TransferState.SUCCESS:
            raise TransferError(f"READ from {peer} failed: {handle.error or state.name}")
    finally:
        _release(handle, peer)


def _release(handle: ReadHandle, peer: str) -> None:
    try:
        handle.release()
    except Exception:
        log.exception("a READ from %s could not be aborted; waiting for it to end", peer)
        while handle.poll() == TransferState.TRANSFERRING:
            time.sleep(POLL_S)  # blocking: the loop must not run on meanwhile
