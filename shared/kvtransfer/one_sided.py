"""The one-sided transfer over any `KVTransport` (nixl, fake, vllm-nixl): the prefill side
sends a `KVReady` naming its held blocks and where its cache is; the decode side checks
the offer against its cache and reservation, READs the blocks straight into the reserved
ones, then answers — so the prefill worker keeps its blocks held (and its agent serving)
until that answer, or its own deadline, which comes after the READ's.
"""

from __future__ import annotations

import asyncio
import time

from shared.bus import Headers
from shared.engine.errors import InvalidRequest
from shared.engine.kv_handoff import HeldBlocks
from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.nats_transport import ChunkSender, ControlledSender
from shared.kvtransfer.read_hold import HoldFile
from shared.kvtransfer.transfer import (
    Awaiting,
    KVMessage,
    KVPins,
    KVTransport,
    Received,
    ReceiveEvents,
    TransferState,
    read_blocks,
)
from shared.protocol import KVDone, KVReady


class OneSidedSender(ControlledSender):
    def __init__(
        self,
        control: ChunkSender,
        request_id: str,
        first_token_id: int,
        transport: KVTransport,
        agent: str,  # this worker's agent name
    ) -> None:
        super().__init__(control, request_id, first_token_id)
        self.name = transport.name
        self.transport = transport
        self.agent = agent

    async def send(self, first_block: int, blocks: HeldBlocks, engine_params: bytes) -> None:
        """Tell the decode worker where the blocks are; it READs them and answers."""
        layout = self.transport.layout
        read_for = max(0.0, self.control.deadline - asyncio.get_running_loop().time()) / 2
        ready = KVReady(
            request_id=self.request_id,
            transport=self.name,
            agent=self.agent,
            agent_metadata=self.transport.metadata(),
            num_cache_blocks=self.transport.num_blocks,
            layout=[layout.num_layers, *layout.block_shape],
            dtype=layout.dtype,
            first_block=first_block,
            block_ids=blocks.block_ids[first_block:],
            block_hashes=blocks.block_hashes[first_block:],
            first_token_id=self.first_token_id,
            read_by=time.time() + read_for,
            engine_params=engine_params,
        )
        with self.transport.serving():
            await self._transferring(self.control.finish(ready))


class OneSidedReceiver:
    def __init__(
        self,
        transport: KVTransport | None,  # None: this worker has none (every offer is refused)
        pins: KVPins,
        request: Awaiting,
        events: ReceiveEvents,
        holds: HoldFile | None = None,  # tests only (read_hold.py)
    ) -> None:
        self.name = transport.name if transport is not None else "none"
        self.holds = holds
        self.transport = transport
        self.pins = pins
        self.request = request
        self.events = events
        self.received = Received()
        self.state = TransferState.WAITING_FOR_INPUT
        self._read: asyncio.Task[object] | None = None  # the task whose READ is in flight

    def poll(self) -> TransferState:
        return self.state

    async def on_message(self, message: KVMessage, headers: Headers) -> None:
        if isinstance(message, KVReady):
            await self._on_ready(message, headers)
        elif isinstance(message, KVDone) and not message.ok:  # the prefill side stopped
            self.abort()
            self.received.error = message.error or message.outcome.name.lower()
            self._move(TransferState.FAILED)
        else:
            raise InvalidRequest("transport", f"this transfer moves its KV by {self.name}")

    def abort(self) -> None:
        if self._read is not None:
            self._read.cancel()

    async def _on_ready(self, ready: KVReady, headers: Headers) -> None:
        """Check the offer, READ it into the reserved blocks, then decode. Raising refuses
        it (the prefill worker fails the request; its gateway migrates it)."""
        self.received.headers = headers
        try:
            transport, local_blocks = self._check(ready)
            self._move(TransferState.TRANSFERRING)
            if local_blocks:
                try:
                    transport.connect(ready.agent, ready.agent_metadata, ready.num_cache_blocks)
                except ValueError as exc:
                    raise InvalidRequest("agent_metadata", str(exc)) from None
                read_by = asyncio.get_running_loop().time() + ready.read_by - time.time()
                self._read = asyncio.current_task()  # `abort` cancels it: the request lets go
                await read_blocks(
                    transport,
                    ready.agent,
                    ready.block_ids,
                    local_blocks,
                    read_by,
                    self.holds,
                    keep=self.pins.pinned(ready.request_id),  # freed once the READ has ended
                )
                self._read = None
        except Exception as exc:
            self.received.error = f"kv transfer failed: {exc}"
            self._move(TransferState.FAILED)
            raise
        layout = transport.layout
        self.received.num_blocks = len(local_blocks)
        self.received.num_bytes = len(local_blocks) * layout.block_bytes * layout.num_layers
        self.received.first_token_id = ready.first_token_id
        self.received.engine_params = ready.engine_params
        self._move(TransferState.SUCCESS)

    def _check(self, ready: KVReady) -> tuple[KVTransport, list[int]]:
        """The transport and the reserved block ids the offered blocks go to, after every
        check (InvalidRequest before any byte moves)."""
        transport, request = self.transport, self.request
        if transport is None or ready.transport != transport.name:
            raise InvalidRequest("transport", f"this worker takes no KV by {ready.transport!r}")
        layout: KVLayout = transport.layout
        expected = [layout.num_layers, *layout.block_shape]
        if ready.layout != expected or ready.dtype != layout.dtype:
            reason = f"{ready.layout} {ready.dtype} is not this worker's {expected} {layout.dtype}"
            raise InvalidRequest("layout", reason)
        offered = range(ready.first_block, ready.first_block + len(ready.block_ids))
        if offered != range(request.skip_blocks, request.num_blocks):
            reason = f"blocks {offered} offered, [{request.skip_blocks}, {request.num_blocks}) due"
            raise InvalidRequest("block_ids", reason)
        if len(ready.block_hashes) != len(ready.block_ids):
            raise InvalidRequest("block_hashes", "one hash per block")
        if any(not 0 <= b < ready.num_cache_blocks for b in ready.block_ids):
            raise InvalidRequest("block_ids", f"ids outside [0, {ready.num_cache_blocks})")
        local = self.pins.reserved(request.request_id, ready.first_block, ready.block_hashes)
        return transport, local

    def _move(self, state: TransferState) -> None:
        self.state = state
        self.events.on_receive(self.request, state)
