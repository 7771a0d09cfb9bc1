"""`KVLink`: a worker's transports, and the one place that picks each transfer's sender and
receiver, so the worker's roles never ask which transport runs.

The transport of a transfer is agreed per worker pair: the decode worker's reservation
lists what it takes (`names`, best first), and the prefill worker picks its one-sided
transport where the decode worker takes it, else `nats`. On the decode side the first
message of a transfer says which it is (`KVReady`: one-sided; a chunk or `KVDone`: nats);
`KVReceivers` answers the decode worker's KV subject (nats_transport.serve_kv) and feeds
each request's messages to its receiver, once the process epochs they carry pass the
link's `Fence` (fence.py). Every sender stamps this process's epoch and the receiving one's
(the reservation's) on each message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.bus import Bus, Headers
from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.fence import Fence
from shared.kvtransfer.nats_transport import ChunkSender, NatsReceiver, NatsSender
from shared.kvtransfer.one_sided import OneSidedReceiver, OneSidedSender
from shared.kvtransfer.read_hold import HoldFile, hold_file
from shared.kvtransfer.transfer import (
    Awaiting,
    KVCopier,
    KVMessage,
    KVPins,
    KVReceiver,
    KVSender,
    KVTransport,
    ReceiveEvents,
)
from shared.protocol import KVChunk, KVDone, KVReady


@dataclass(slots=True)
class KVLink:
    bus: Bus
    agent: str  # this worker's id: its one-sided agent's name
    layout: KVLayout  # of this worker's cache
    window: int  # chunks unacknowledged at once
    headroom: int  # bytes of a chunk's frame besides its data
    pins: KVPins  # the engine's reservations
    copier: KVCopier | None  # the engine's block copies; None: no `nats` transport
    one_sided: KVTransport | None  # nixl, fake or vllm-nixl; None: none here
    epoch: int = 0  # this process's (shared/epoch.py)
    holds: HoldFile | None = field(default_factory=hold_file)  # tests only (read_hold.py)
    fence: Fence = field(init=False)

    def __post_init__(self) -> None:
        self.fence = Fence(self.epoch)

    @property
    def names(self) -> list[str]:
        """What this worker can take KV by, best first."""
        names = [self.one_sided.name] if self.one_sided is not None else []
        return names + (["nats"] if self.copier is not None else [])

    def sender(
        self,
        request_id: str,
        first_token_id: int,
        subject: str,  # the decode worker's KV subject
        offered: list[str],  # what the decode worker takes
        deadline: float,  # on the event loop's clock
        to_epoch: int = 0,  # the decode process's, from its reservation
    ) -> KVSender:
        epochs = (self.epoch, to_epoch)
        control = ChunkSender(self.bus, subject, self.window, deadline, epochs=epochs)
        if self.one_sided is not None and self.one_sided.name in offered:
            return OneSidedSender(control, request_id, first_token_id, self.one_sided, self.agent)
        max_bytes = self.bus.max_payload - self.headroom
        return NatsSender(control, request_id, first_token_id, self.copier, max_bytes)

    def receiver(self, first: KVMessage, request: Awaiting, events: ReceiveEvents) -> KVReceiver:
        """The receiver of `request`'s transfer, whose first message is `first`."""
        if isinstance(first, KVReady):  # it refuses a transport this worker has not
            return OneSidedReceiver(self.one_sided, self.pins, request, events, self.holds)
        return NatsReceiver(self.layout, self.copier, request, events)

    def close(self) -> None:
        if self.one_sided is not None:
            self.one_sided.close()


@dataclass(slots=True)
class KVReceivers:
    """The decode worker's KV subject: each message to its request's receiver."""

    link: KVLink
    events: ReceiveEvents

    async def on_chunk(self, chunk: KVChunk, headers: Headers) -> None:
        await self._receive(chunk, headers)

    async def on_done(self, done: KVDone, headers: Headers) -> None:
        await self._receive(done, headers)

    async def on_ready(self, ready: KVReady, headers: Headers) -> None:
        await self._receive(ready, headers)

    async def _receive(self, message: KVMessage, headers: Headers) -> None:
        fence = self.link.fence
        fence.check(message, None)
        request = self.events.awaiting(message.request_id)
        if request.receiver is None:
            request.receiver = self.link.receiver(message, request, self.events)
            request.sender_epoch = message.epoch
        else:
            fence.check(message, request.sender_epoch)
        await request.receiver.on_message(message, headers)
