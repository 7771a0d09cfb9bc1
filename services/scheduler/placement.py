"""One try at placing a request on the workers the registry knows (no waiting here).

Only the workers of the request's model are candidates (all workers when it names none).
Every NATS request is bounded by `reserve_timeout` and the placement's give-up time, and
given up at once when the sweeper finds the worker it waits on lost (`worker_lost`):
  decode candidates (room in the registry), best first → the path, by cost (path_cost.py),
  kept off the KV links of hand-offs that failed (hand_offs.py)
  (the ranking and the choice are pure: route_plan.py, which the simulator runs too)
    local (cheaper, cold rule, or no prefill pool): DecodeTask → OK: placed (decode only)
    split: Reserve → not OK: next decode candidate
         PrefillTask to each prefill candidate in turn, cheapest first → OK: placed
         none took it: Cancel (reason RELEASED: frees the reservation) → no room
  no candidate left (none in the registry, or all BUSY, UNAVAILABLE, FAILED or lost) → no room
A worker that does not answer, or is lost, counts as FAILED. An INVALID answer from any
worker raises `BadSubmit`: the request itself is bad and no other worker would take it.
Each placement records the prefix hit it predicted for the worker computing the prompt, and
on a split path compares the decode worker's reservation with its prediction (hit_check.py).
With --kv-peer-reads the task names a worker holding more of the prefix (peer_prefix.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from nats.errors import Error as NatsError
from opentelemetry import trace

from services.scheduler.config import SchedulerConfig
from services.scheduler.hand_offs import HandOffs
from services.scheduler.hit_check import HitBook, predicted_tokens
from services.scheduler.path_cost import Path, uncached_tokens
from services.scheduler.peer_prefix import peer_prefix, with_peer
from services.scheduler.registry import Registry
from services.scheduler.route_plan import plan_route
from services.scheduler.routing import Candidate, WorkerView
from shared.bus import Bus, Headers
from shared.engine.engine_config import NATIVE_BLOCK_SIZE
from shared.prefix_messages import PeerPrefix
from shared.protocol import (
    Cancel,
    DecodeTask,
    Outcome,
    PrefillTask,
    Reservation,
    Reserve,
    SubmitAck,
    SubmitRequest,
    TaskAck,
    WireError,
)
from shared.subjects import Subjects

log = logging.getLogger(__name__)
Reply = TypeVar("Reply", TaskAck, Reservation)

# The reason of the Cancel a try publishes to free its own reservation before the request
# waits: workers free the blocks; schedulers do not take it for the gateway's Cancel.
RELEASED = "released by the scheduler: the request waits for room"
RTT_ALPHA = 0.2  # weight of the newest Reserve round trip in its average


class WorkerGone(Exception):
    """The worker a placement was waiting on stopped beating (the sweeper expired it)."""


class BadSubmit(Exception):
    """A worker answered INVALID: its engine found the submitted request itself bad (the
    engine's `InvalidRequest`), so no other worker would take it; the submit is answered
    INVALID."""


@dataclass(frozen=True, slots=True)
class NoRoom:
    """One try placed nothing, and no worker refused the request for good: it may wait."""

    reason: str
    asked: bool  # workers were asked and refused (busy, failed, lost): the mesh is full now


_REQUEST_ERRORS = (TimeoutError, NatsError, WireError, WorkerGone)


class Placer:
    def __init__(
        self,
        config: SchedulerConfig,
        bus: Bus,
        registry: Registry,
        clock: Callable[[], float],
        is_cancelled: Callable[[str], bool],
        hits: HitBook | None = None,
        hand_offs: HandOffs | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.registry = registry
        self.clock = clock
        self.is_cancelled = is_cancelled
        # predicted against actual prefix hits (an empty book is falsy: no `or` here)
        self.hits = hits if hits is not None else HitBook()
        self.hand_offs = hand_offs if hand_offs is not None else HandOffs(registry, clock)
        self.subjects = Subjects(config.common.namespace)
        # Requests to workers in flight (worker id -> their tasks): cancelled when the worker
        # is lost, so a placement moves on without waiting out `reserve_timeout`.
        self.asking: dict[str, set[asyncio.Task[object]]] = {}
        self.reserve_rtt = 0.0  # seconds, an average of the Reserve round trips (0: none yet)

    def worker_lost(self, worker_id: str) -> None:
        for call in self.asking.pop(worker_id, set()):
            call.cancel()

    async def place(
        self, request: SubmitRequest, headers: Headers, give_up: float
    ) -> SubmitAck | NoRoom:
        cfg = self.config
        tokens = request.prompt_token_ids + request.delivered_token_ids
        model_id = self.registry.model_id(request.model, cfg.model_id)
        block_size = self.registry.block_size(request.model, cfg.block_size or NATIVE_BLOCK_SIZE)
        views, adapter = self.registry.views(request.model), request.sampling.adapter
        max_tokens = request.sampling.max_tokens
        plan = plan_route(
            views, tokens, model_id, request.model, cfg, adapter, max_tokens, block_size
        )
        if not plan.decodes:
            return NoRoom(plan.no_room, asked=False)
        hashes, prefills = plan.hashes, plan.prefills
        refusal, avoid = "", self.hand_offs.avoid(request)
        for decode in plan.decodes:
            choice = plan.choose(decode, cfg, self.reserve_rtt, avoid)
            span = trace.get_current_span()
            span.set_attribute("splitserve.prefix_hit_blocks", decode.overlap)
            span.set_attribute("splitserve.path_rule", choice.rule.name.lower())
            if choice.path is Path.LOCAL:
                hint = self._peer(views, hashes, decode, len(tokens), block_size)
                subject, task = self.subjects.decode(decode.worker_id), DecodeTask(request, hint)
                ack = await self._task(decode.worker_id, subject, task, request, headers, give_up)
                if ack.ok:
                    self.hand_offs.count(choice.rule)
                    self._predict_hit(request, with_peer(decode, hint), len(tokens), block_size)
                    computed = uncached_tokens(len(tokens), decode.overlap, block_size)
                    self._assign(request, decode.worker_id, len(tokens), computed)
                    self.registry.expect_cached(decode.worker_id, hashes)
                    return SubmitAck(
                        request.request_id,
                        Outcome.OK,
                        decode_worker=decode.worker_id,
                        predicted_ttft=choice.predicted_ttft,
                    )
                refusal = _refusal(decode.worker_id, ack.outcome, ack.error)
                continue
            reservation = await self._reserve(request, decode, headers, give_up)
            if not reservation.ok:
                refusal = _refusal(decode.worker_id, reservation.outcome, reservation.error)
                continue
            self._check_reservation(request, decode, reservation, len(tokens), block_size)
            for prefill_id, predicted_ttft in choice.prefills:
                prefill = prefills[prefill_id]
                if self.is_cancelled(request.request_id):  # Cancel frees the reservation too
                    return SubmitAck(
                        request.request_id, Outcome.UNAVAILABLE, "cancelled while being placed"
                    )
                hint = self._peer(views, hashes, prefill, len(tokens), block_size)
                ack = await self._prefill(
                    request, prefill, decode, reservation, hint, headers, give_up
                )
                if ack.ok:
                    self.hand_offs.placed(request, prefill.worker_id, decode.worker_id)
                    self._predict_hit(request, with_peer(prefill, hint), len(tokens), block_size)
                    self._assign(request, decode.worker_id, len(tokens))
                    computed = uncached_tokens(len(tokens), prefill.overlap, block_size)
                    self._assign(request, prefill.worker_id, 0, computed)
                    # The decode worker holds the blocks only once the transfer is done.
                    self.registry.expect_cached(prefill.worker_id, hashes)
                    return SubmitAck(
                        request.request_id,
                        Outcome.OK,
                        prefill_worker=prefill.worker_id,
                        decode_worker=decode.worker_id,
                        predicted_ttft=predicted_ttft,
                    )
                refusal = _refusal(prefill.worker_id, ack.outcome, ack.error)
            await self.bus.publish(
                self.subjects.cancel, Cancel(request.request_id, RELEASED), headers=headers
            )
            return NoRoom(f"no prefill worker took the request (last: {refusal})", asked=True)
        return NoRoom(f"no decode worker took the request (last: {refusal})", asked=True)

    def _predict_hit(
        self, request: SubmitRequest, worker: Candidate, num_tokens: int, block_size: int
    ) -> None:
        """`worker` computes the prompt: its predicted hit on the route span and in the book,
        for its first token's report to be compared with."""
        span = trace.get_current_span()
        span.set_attribute("splitserve.prefix_predicted_blocks", worker.overlap)
        span.set_attribute("splitserve.prefix_tier_blocks", worker.tier_blocks)
        predicted = predicted_tokens(worker.overlap, num_tokens, block_size)
        route = trace.set_span_in_context(span)
        self.hits.remember(request.request_id, worker.worker_id, predicted, block_size, route)

    def _peer(
        self, views: list[WorkerView], hashes: list[int], computer: Candidate, tokens: int, bs: int
    ) -> PeerPrefix | None:
        """With --kv-peer-reads: the worker `computer` may read more of the prefix from."""
        if not self.config.kv_peer_reads:
            return None
        hint = peer_prefix(views, hashes, computer.worker_id, computer.overlap, tokens, bs)
        if hint is not None:  # the holder and its blocks, on the route span
            span = trace.get_current_span()
            span.set_attribute("splitserve.prefix_peer", hint.holder)
            span.set_attribute("splitserve.prefix_peer_blocks", hint.num_blocks)
        return hint

    def _check_reservation(
        self,
        request: SubmitRequest,
        decode: Candidate,
        reservation: Reservation,
        num_tokens: int,
        block_size: int,
    ) -> None:
        """The decode worker's reservation says what it holds: against what was predicted."""
        trace.get_current_span().set_attribute(
            "splitserve.reserve_cached_blocks", reservation.num_cached_blocks
        )
        predicted = predicted_tokens(decode.overlap, num_tokens, block_size)
        actual = reservation.num_cached_blocks * block_size
        side, worker = "reserve", decode.worker_id
        self.hits.compare(side, request.request_id, worker, predicted, actual, block_size)

    def _assign(
        self, request: SubmitRequest, worker_id: str, num_tokens: int, computed: int = 0
    ) -> None:
        """`num_tokens` take blocks on the worker; it computes `computed` prompt tokens."""
        self.registry.assign(
            worker_id, request.request_id, request.deadline, num_tokens, prompt_tokens=computed
        )

    def _timeout(self, give_up: float) -> float:
        return max(0.001, min(self.config.reserve_timeout, give_up - self.clock()))

    async def _prefill(
        self,
        request: SubmitRequest,
        prefill: Candidate,
        decode: Candidate,
        reservation: Reservation,
        hint: PeerPrefix | None,
        headers: Headers,
        give_up: float,
    ) -> TaskAck:
        task = PrefillTask(
            request,
            decode.worker_id,
            reservation.num_cached_blocks,
            reservation.transports,
            reservation.epoch,
            hint,
        )
        subject = self.subjects.prefill(prefill.worker_id)
        return await self._task(prefill.worker_id, subject, task, request, headers, give_up)

    async def _ask(
        self,
        worker_id: str,
        subject: str,
        message: Reserve | DecodeTask | PrefillTask,
        reply_type: type[Reply],
        headers: Headers,
        give_up: float,
    ) -> Reply:
        """Request/reply with one worker, bounded by `_timeout`; WorkerGone as soon as the
        sweeper finds that worker lost (NATS may still hold the message for a dead one)."""
        call = asyncio.ensure_future(
            self.bus.request(subject, message, reply_type, self._timeout(give_up), headers=headers)
        )
        calls = self.asking.setdefault(worker_id, set())
        calls.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this placement itself is being cancelled
            raise WorkerGone(f"worker {worker_id} was lost") from None
        finally:
            calls.discard(call)
            if not calls and self.asking.get(worker_id) is calls:
                del self.asking[worker_id]

    async def _task(
        self,
        worker_id: str,
        subject: str,
        task: DecodeTask | PrefillTask,
        request: SubmitRequest,
        headers: Headers,
        give_up: float,
    ) -> TaskAck:
        try:
            ack = await self._ask(worker_id, subject, task, TaskAck, headers, give_up)
        except _REQUEST_ERRORS as exc:
            log.warning("%s: %s failed: %r", request.request_id, subject, exc)
            return TaskAck(request.request_id, Outcome.FAILED, f"no answer: {exc!r}")
        _check_valid(request, subject, ack.outcome, ack.error)
        return ack

    async def _reserve(
        self, request: SubmitRequest, decode: Candidate, headers: Headers, give_up: float
    ) -> Reservation:
        subject = self.subjects.reserve(decode.worker_id)
        began = self.clock()
        try:
            reservation = await self._ask(
                decode.worker_id, subject, Reserve(request), Reservation, headers, give_up
            )
        except _REQUEST_ERRORS as exc:
            log.warning("%s: reserve on %s failed: %r", request.request_id, decode.worker_id, exc)
            return Reservation(request.request_id, Outcome.FAILED, error=f"no answer: {exc!r}")
        rtt = max(0.0, self.clock() - began)
        self.reserve_rtt += RTT_ALPHA * (rtt - self.reserve_rtt) if self.reserve_rtt else rtt
        _check_valid(request, subject, reservation.outcome, reservation.error)
        return reservation


def _check_valid(request: SubmitRequest, subject: str, outcome: Outcome, error: str) -> None:
    """Log a refusal; BadSubmit when the worker found the request itself bad."""
    if outcome == Outcome.OK:
        return
    log.info("%s: %s answered %s: %s", request.request_id, subject, outcome.name, error)
    if outcome == Outcome.INVALID:
        raise BadSubmit(error)


def _refusal(worker_id: str, outcome: Outcome, error: str) -> str:
    return f"{worker_id} {outcome.name.lower()}" + (f": {error}" if error else "")
