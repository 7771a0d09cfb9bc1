"""How KV moves between workers: one interface for every transport, and the READ shape the
one-sided transports share.

`KVSender` (prefill side) and `KVReceiver` (decode side) are one transfer each, with a
poll state (`TransferState`). Implementations: `nats` (nats_transport.py: chunks pushed on
the decode worker's KV subject, then `KVDone`) and the one-sided ones (one_sided.py: a
`KVReady` naming the blocks, which the decode worker READs straight out of the prefill
worker's registered cache) over any `KVTransport` — `nixl` (nixl_transport.py), `fake` (an
in-process copy for tests, fake_transport.py), `vllm-nixl` (vLLM's connector). link.py
picks the sender and receiver of each transfer, so the worker's roles never ask which
transport runs. NATS always carries the control messages (`KVReady`, `KVDone`, aborts).

| state | meaning |
|---|---|
| BOOTSTRAPPING | the peer's metadata is being loaded |
| WAITING_FOR_INPUT | nothing asked yet |
| TRANSFERRING | bytes are moving: the receiving blocks must stay reserved |
| SUCCESS | every byte is in the receiving blocks |
| FAILED | nothing can be trusted in the receiving blocks; `error` says why |

A one-sided `KVTransport` is made once per worker over its paged cache (one tensor per
layer, [num_blocks, block_size, 2, kv_heads, head_dim], on the CPU or a GPU); its
`metadata()` travels in the mesh's own messages (`KVReady`), never through a side channel.
A decode worker `connect`s to a peer once (by agent name), then each transfer is one
`start_read` whose handle it polls until SUCCESS or FAILED, within a deadline.

The one subtle rule (`read_blocks`): the blocks a READ writes into are not freed before it
has ended, even when it is given up on (a deadline, a cancel): NIXL cannot stop a READ in
flight, and bytes landing later would overwrite another request's KV.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, AsyncExitStack
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

from shared.bus import Headers
from shared.engine.kv_handoff import HeldBlocks, KVBlocks
from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.read_hold import HoldFile, HoldPoint
from shared.protocol import KVChunk, KVDone, KVReady

if TYPE_CHECKING:
    import torch

KVMessage = KVChunk | KVDone | KVReady  # what a decode worker's KV subject carries

log = logging.getLogger(__name__)
POLL_S = 0.0005  # between polls of a READ in flight: a small share of a many-block READ


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
        """Free the handle of a READ that has ended (SUCCESS or FAILED). Not for one in
        flight: NIXL frees the request then, but cannot stop its bytes (`read_blocks`)."""


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


# -- what a transfer needs of its engine ----------------------------------------------------
class KVCopier(Protocol):
    """Copies of whole blocks out of a held request and into a reservation (the `nats`
    transport ships them as chunks)."""

    async def export(self, request_id: str, first_block: int) -> KVBlocks:
        """A held request's blocks from `first_block` on, every layer, in one copy."""

    async def write(self, request_id: str, blocks: KVBlocks) -> None:
        """Write received blocks into a reservation (checked against it first)."""


class KVPins(Protocol):
    """A decode engine's reservations, as a one-sided READ needs them."""

    def reserved(
        self, request_id: str, first_block: int, block_hashes: list[int | None]
    ) -> list[int]:
        """The reservation's block ids from `first_block` on, one per hash, after checking
        each full block's hash against the prompt (InvalidRequest)."""

    def pinned(self, request_id: str) -> AbstractAsyncContextManager[None]:
        """Keep the request's blocks while the body runs; an abort meanwhile waits."""


# -- the interface every transport implements ---------------------------------------------
class KVSender(Protocol):
    """The prefill side of one request's transfer."""

    name: str  # the transport's
    headers: Headers | None  # the trace context every message of the transfer carries

    def poll(self) -> TransferState: ...

    async def send(self, first_block: int, blocks: HeldBlocks, engine_params: bytes) -> None:
        """Move the held `blocks` from `first_block` on (the receiver holds the rest) and hand
        the receiver the first token; returns once it has every block (TransferError
        otherwise). `engine_params`: what the decode engine needs besides the blocks."""

    async def abort(self, reason: str) -> None:
        """Stop; tell the receiver (best effort) to drop the request."""


@dataclass(slots=True)
class Received:
    """What a receiver has taken so far, and at SUCCESS what decoding starts with."""

    num_blocks: int = 0  # blocks written, each once however many layer groups
    num_bytes: int = 0
    first_token_id: int = -1
    engine_params: bytes = b""  # the prefill engine's, for the decode engine
    headers: Headers = field(default_factory=dict)  # of the message that ended it
    error: str = ""  # FAILED: why


class KVReceiver(Protocol):
    """The decode side of one request's transfer, fed the KV subject's messages for it."""

    name: str  # the transport's
    received: Received

    def poll(self) -> TransferState: ...

    async def on_message(self, message: KVMessage, headers: Headers) -> None:
        """Take one message; raising refuses it (the sender fails the transfer)."""

    def abort(self) -> None:
        """Stop now: a READ in flight is given up on (its source may be dead); the blocks it
        writes stay pinned until it ends (`read_blocks`)."""


class Awaiting(Protocol):
    """A reservation awaiting its KV (the decode worker's entry for the request)."""

    @property
    def request_id(self) -> str: ...

    num_blocks: int  # reserved for the whole prompt
    skip_blocks: int  # leading blocks already held here: not sent
    receiver: KVReceiver | None  # set by the first message of its transfer
    sender_epoch: int  # the sending process's, from that first message (fence.py)


class ReceiveEvents(Protocol):
    """The decode side, as receivers see it."""

    def awaiting(self, request_id: str) -> Awaiting:
        """The reservation the message is for (UnknownRequest when none awaits KV)."""

    def on_receive(self, request: Awaiting, state: TransferState) -> None:
        """The receiver's state changed (TRANSFERRING again: more blocks came)."""


async def read_blocks(
    transport: KVTransport,
    peer: str,
    remote_blocks: list[int],
    local_blocks: list[int],
    deadline: float,
    holds: HoldFile | None = None,  # tests only (read_hold.py)
    keep: AbstractAsyncContextManager[object] | None = None,
) -> None:
    """One READ, polled on the event loop until it is over; `deadline` on the loop's clock.
    `keep` is what keeps `local_blocks` from being freed (a reservation's pin): entered
    before the READ is posted and exited once no byte of it can land any more. A READ that
    ends is released and `keep` exited at once; one given up on while in flight (its
    deadline passed, the caller was cancelled) raises at once, but its handle and `keep`
    go to a task that waits it out (`_wait_out`): releasing a READ does not stop it (NIXL
    over UCX cannot cancel an RMA GET; the request is freed and the bytes still come), and
    they would land in blocks someone else owns by then."""
    loop = asyncio.get_running_loop()
    hold = holds.claim() if holds is not None else None
    async with AsyncExitStack() as stack:
        if keep is not None:
            await stack.enter_async_context(keep)
        if hold is not None:
            await hold.at(HoldPoint.BEFORE, peer, len(local_blocks), None)
        handle = transport.start_read(peer, remote_blocks, local_blocks)
        try:
            if hold is not None:
                await hold.at(HoldPoint.IN_FLIGHT, peer, len(local_blocks), handle)
            while (state := handle.poll()) == TransferState.TRANSFERRING:
                if loop.time() > deadline:
                    blocks = len(local_blocks)
                    raise TransferError(f"READ of {blocks} blocks from {peer} passed its deadline")
                await asyncio.sleep(POLL_S)
            if state != TransferState.SUCCESS:
                raise TransferError(f"READ from {peer} failed: {handle.error or state.name}")
            if hold is not None:
                await hold.at(HoldPoint.LANDED, peer, len(local_blocks), handle)
        finally:
            if handle.poll() == TransferState.TRANSFERRING:
                _wait_out(handle, peer, len(local_blocks), stack.pop_all())
            else:
                _release(handle, peer)


_ABANDONED: set[asyncio.Task[None]] = set()  # READs given up on in flight, until they end
WAIT_OUT_POLL_S = 0.01  # between polls of a READ given up on: nobody waits for it


def _wait_out(handle: ReadHandle, peer: str, blocks: int, keep: AsyncExitStack) -> None:
    """Poll a READ given up on in flight until it ends, then release it and exit `keep`
    (its local blocks may be freed from then on), in a task of its own."""
    log.warning(
        "a READ of %d blocks from %s was given up on in flight: they stay held until it ends",
        blocks,
        peer,
    )

    async def wait() -> None:
        async with keep:
            while (state := handle.poll()) == TransferState.TRANSFERRING:
                await asyncio.sleep(WAIT_OUT_POLL_S)
            _release(handle, peer)
            log.warning("the READ from %s given up on has ended (%s)", peer, state.name)

    task = asyncio.get_running_loop().create_task(wait())
    _ABANDONED.add(task)  # a reference until it is done
    task.add_done_callback(_ABANDONED.discard)


def _release(handle: ReadHandle, peer: str) -> None:
    """Free the handle of a READ that has ended."""
    try:
        handle.release()
    except Exception:
        log.exception("the handle of a READ from %s could not be released", peer)
