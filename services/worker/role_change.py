"""A worker's intake per role, and its role changing while serving (DESIGN.md section 9).

`Intake` holds each side's subscriptions — prefill: `prefill`; decode: `reserve`, `decode`,
`kv` — and serves those of the worker's role. `RoleChange` answers `SetRole`; a change
passes through, in order:

changing   `WorkerContext.next_role` is set and a heartbeat carries it: the scheduler places
           nothing on the worker, and the sides the new role drops refuse new work
           (UNAVAILABLE "changing role").
finishing  what the dropped sides hold ends as it would have: prefill its prompts and their
           hand-offs, decode its reservations and running streams. With `hurry`, or once
           `role_change_timeout` has passed, what a dropped side runs in the engine is failed
           with an error chunk, so its gateway migrates it (a seeded stream stays exact);
           reservations and KV in flight finish under their own deadlines (a reservation
           whose KV comes joins the engine, and fails there).
switched   the dropped sides' subjects are closed, the added ones opened, `config.role`
           replaced (the one place the worker's role is kept), and a heartbeat announces it.

The one subtle rule: a dropped side's subjects stay subscribed until it holds nothing (the
`kv` subject carries the KV of reservations made before the change), refusing new work.
A SIGTERM's drain ends a change where it is: the worker is going away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from services.worker.config import role_takes
from services.worker.context import CHANGING, WorkerContext
from services.worker.decode import DecodeSide
from services.worker.prefill import PrefillSide
from services.worker.requests import RequestState, WorkerRequest
from shared.bus import Bus
from shared.kvtransfer.link import KVReceivers
from shared.kvtransfer.nats_transport import serve_kv
from shared.nats_permissions import may_serve
from shared.protocol import DecodeTask, Outcome, PrefillTask, Reservation, Reserve, SetRole, TaskAck
from shared.telemetry.tracing import extract

log = logging.getLogger(__name__)
M = TypeVar("M")
R = TypeVar("R")
POLL_S = 0.05  # how often a change looks whether the dropped sides still hold requests


class Intake:
    """The subjects each side of the worker answers, subscribed per role."""

    def __init__(self, ctx: WorkerContext, prefill: PrefillSide, decode: DecodeSide) -> None:
        self.ctx = ctx
        self.prefill = prefill
        self.decode = decode
        self._open: dict[bool, list[Subscription]] = {}  # decodes → that side's subscriptions

    async def serve(self, role: str) -> None:
        """Answer the subjects of `role`'s sides, and only those (again after a failure)."""
        for decodes in (False, True):
            if role_takes(role, decodes) and decodes not in self._open:
                self._open[decodes] = await (self._decode() if decodes else self._prefill())
            elif not role_takes(role, decodes) and decodes in self._open:
                for subscription in self._open.pop(decodes):
                    await subscription.unsubscribe()

    async def _prefill(self) -> list[Subscription]:
        ctx, wid = self.ctx, self.ctx.config.worker_id
        subject = ctx.subjects.prefill(wid)
        return [await serve(ctx.bus, subject, PrefillTask, self.prefill.on_task, refuse)]

    async def _decode(self) -> list[Subscription]:
        bus, subjects, wid = self.ctx.bus, self.ctx.subjects, self.ctx.config.worker_id
        side = self.decode
        return [
            await serve(bus, subjects.reserve(wid), Reserve, side.on_reserve, _refuse_reserve),
            await serve(bus, subjects.decode(wid), DecodeTask, side.on_task, refuse),
            await serve_kv(bus, subjects.kv(wid), KVReceivers(self.ctx.link, side)),
        ]


class RoleChange:
    """Answers `SetRole`; at most one change at a time."""

    def __init__(self, ctx: WorkerContext, intake: Intake, beat: Callable[[], Awaitable[None]]):
        self.ctx = ctx
        self.intake = intake
        self.beat = beat  # publishes a heartbeat now
        self.task: asyncio.Task[None] | None = None  # the change under way, or the last one

    async def start(self) -> None:
        ctx = self.ctx
        await serve(
            ctx.bus, ctx.subjects.role(ctx.config.worker_id), SetRole, self.on_set_role, refuse
        )

    async def on_set_role(self, message: SetRole, parent: Context) -> TaskAck:
        ctx, role = self.ctx, message.role
        if ctx.draining:
            return TaskAck("", Outcome.UNAVAILABLE, "draining")
        if ctx.next_role:
            return TaskAck("", Outcome.UNAVAILABLE, f"{CHANGING} to {ctx.next_role} already")
        auth = ctx.config.common.nats_auth
        user = auth.nats_user if auth is not None else ""
        if not may_serve(user, role, ctx.subjects):
            why = f"NATS user {user} may not serve role {role}: connect the worker as 'both'"
            return TaskAck("", Outcome.UNAVAILABLE, why)
        ctx.next_role = role
        self.task = asyncio.create_task(self._change(role, message.hurry))
        return TaskAck("", Outcome.OK)

    async def _change(self, role: str, hurry: bool) -> None:
        try:
            await self._finish_then_switch(role, hurry)
        except Exception:  # a lost connection: it serves on as it is, and may be told again
            log.exception("the change to role %s failed", role)
            self.ctx.next_role = ""
            await self._announce()

    async def _finish_then_switch(self, role: str, hurry: bool) -> None:
        ctx, old = self.ctx, self.ctx.config.role
        log.info("changing role: %s → %s%s", old, role, " (hurry)" if hurry else "")
        loop = asyncio.get_running_loop()
        hurry_at = loop.time() + (0.0 if hurry else ctx.config.role_change_timeout)
        await self._announce()
        while held := [e for e in ctx.table if not role_takes(role, e.decodes)]:
            if ctx.draining:
                return
            if loop.time() >= hurry_at:
                self._fail_running(held)
            await asyncio.sleep(POLL_S)
        if ctx.draining:
            return
        await self.intake.serve(role)
        ctx.config = replace(ctx.config, role=role)
        ctx.next_role = ""
        log.info("role changed: %s → %s", old, role)
        await self._announce()

    def _fail_running(self, held: list[WorkerRequest]) -> None:
        """What the engine runs for a dropped side fails, so its gateway migrates it."""
        for entry in held:
            if entry.state == RequestState.ENGINE:
                side = self.intake.decode if entry.decodes else self.intake.prefill
                side.stop(entry, CHANGING, tell_gateway=True)

    async def _announce(self) -> None:
        try:
            await self.beat()
        except Exception:  # a lost connection: the next regular heartbeat says it
            log.exception("heartbeat failed")


async def serve(
    bus: Bus,
    subject: str,
    message_type: type[M],
    handler: Callable[[M, Context], Awaitable[R]],
    refuse: Callable[[str], R],
) -> Subscription:
    """Answer `subject` with `handler(message, trace context of its headers)`, each request
    in its own task: a reservation waits for the engine thread (between steps), and the
    reservations of a wave of prompts must not queue behind one another, one a step."""
    return await bus.serve(
        subject,
        message_type,
        lambda msg, headers: handler(msg, extract(headers)),
        refuse,
        concurrent=True,
    )


def refuse(reason: str) -> TaskAck:
    return TaskAck("", Outcome.INVALID, reason)


def _refuse_reserve(reason: str) -> Reservation:
    return Reservation("", Outcome.INVALID, error=reason)
