"""One `WorkerRequest` per request a worker holds, in one `RequestTable`.

The worker keeps only the states it owns, each with one owner (the side that moves a
request on from it); the order a request passes through them is below the list:

ENGINE        the engine holds it (owner: the engine). Queued, computing, running or held
              are the engine's business, reported in its `StepOutput` (started, outputs,
              held with its blocks); the worker follows those reports and keeps no copy.
RESERVED      decode: blocks reserved for the prompt, no KV yet (owner: the reservation,
              `DecodeSide.on_reserve`; its transfer deadline frees them).
RECEIVING     decode: KV bytes moving in (owner: the transfer's receiver, transfer.py).
TRANSFERRING  prefill: the first token is out and its hand-off owns the request (owner: the
              hand-off task): it picks the sender, moves the blocks the decode worker lacks,
              or tells it to drop its reservation when that token ended the request. The
              engine's HELD is no state here: the hand-off takes a request the moment the
              engine reports it held.

prefill side: ENGINE → TRANSFERRING → gone (released).
decode side:  RESERVED → RECEIVING → ENGINE → gone (finished); a `DecodeTask` (the decode
    worker prefills itself) is ENGINE from the start.

Leaving the table is the one way a request ends here, whatever the cause (finished,
cancelled, failed, past its deadline), so an empty table means nothing is left behind.
Every change of state goes through `RequestTable.move`, which calls the telemetry hooks;
the engine's own transitions reach telemetry from `Worker.on_step`, never as a state here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from opentelemetry.context import Context

from shared.kvtransfer.transfer import KVReceiver
from shared.protocol import SubmitRequest


class RequestState(IntEnum):
    ENGINE = 0
    RESERVED = 1
    RECEIVING = 2
    TRANSFERRING = 3


RECEIVES = (RequestState.RESERVED, RequestState.RECEIVING)  # decode: its KV is not all in


@dataclass(slots=True)
class Trace:
    """What the request's spans need, kept with it (Unix seconds)."""

    parent: Context  # the span the worker's spans hang under
    entered: float  # when the request entered its current state
    first_step: float = 0.0  # start of the engine step that first computed it (0: none yet)
    tokens: int = 0  # tokens generated here
    first_output: float = 0.0  # when its first tokens here were streamed (decode side; TPOT)
    steps: int = 0  # engine steps that produced them
    kv_blocks: int = 0  # KV blocks received (each counted once however many layer groups)
    kv_bytes: int = 0


@dataclass(slots=True)
class WorkerRequest:
    request: SubmitRequest
    state: RequestState
    deadline: float  # event-loop clock; RESERVED/RECEIVING: the transfer deadline
    subject: str  # the gateway's token subject
    next_index: int  # output position of the next token streamed from here
    trace: Trace
    decodes: bool  # the decode side owns it (a DecodeTask starts in ENGINE on that side)
    decode_worker: str = ""  # prefill: where the KV goes
    skip_blocks: int = 0  # leading blocks the decode worker already holds (both sides)
    num_blocks: int = 0  # decode: blocks reserved for the prompt
    transport: str = "nats"  # how its KV moves: agreed at the reservation, chosen by prefill
    offered_transports: list[str] = field(default_factory=list)  # prefill: decode takes these
    hand_off: asyncio.Task[None] | None = None  # prefill: first token out, then the KV
    failure: str = ""  # prefill: why the hand-off was stopped, when the gateway must know
    receiver: KVReceiver | None = None  # decode: its transfer's, once the first message came
    sender_epoch: int = 0  # decode: the process that sent its transfer's first message
    decode_epoch: int = 0  # prefill: the decode process its KV is for (its reservation's)

    @property
    def request_id(self) -> str:
        return self.request.request_id


class StateHooks(Protocol):
    """Told of every change (telemetry); `now` is Unix seconds."""

    def on_move(self, request: WorkerRequest, old: RequestState, now: float) -> None: ...

    def on_end(self, request: WorkerRequest, reason: str, now: float) -> None: ...


class RequestTable:
    def __init__(self, hooks: StateHooks) -> None:
        self.hooks = hooks
        self._requests: dict[str, WorkerRequest] = {}
        self.ended = asyncio.Event()  # set as a request leaves (its blocks freed): beat early

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[WorkerRequest]:
        return iter(list(self._requests.values()))

    def get(self, request_id: str) -> WorkerRequest | None:
        return self._requests.get(request_id)

    def add(self, request: WorkerRequest) -> None:
        assert request.request_id not in self._requests, "check `in` before adding"
        self._requests[request.request_id] = request

    def move(self, request: WorkerRequest, state: RequestState, now: float) -> None:
        old, request.state = request.state, state
        self.hooks.on_move(request, old, now)
        request.trace.entered = now

    def end(self, request: WorkerRequest, reason: str, now: float) -> None:
        """Forget `request` (once: a second end is a no-op). `reason`: finished, cancelled,
        failed, deadline, ..., for its spans."""
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
            self.hooks.on_end(request, reason, now)
            self.ended.set()
