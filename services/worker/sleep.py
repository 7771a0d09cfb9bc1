"""A worker's sleep and wake-up (vLLM's /sleep and /wake_up, sent by the gateway on
`ss.worker.<id>.sleep`; shared/sleep_messages.py).

Falling asleep, in order: take no more work (intake refuses "asleep") and say so in a
heartbeat at once (the scheduler drops it from its candidates), let what it holds finish
within the command's `drain_timeout`, fail what is left (its gateways migrate those streams
to another worker), then have the engine give back its KV pool, and at level 2 its weights.
Waking up: the engine brings back what it gave, the next heartbeat says it is awake, and
the scheduler places on it again. The subtle rule: one command at a time, each answered
once its level is reached; an engine that cannot sleep (a block still in use, an engine
without sleep mode) leaves the worker awake, and the reply says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.worker.context import WorkerContext
from shared.bus import Headers
from shared.protocol import Outcome
from shared.sleep_level import SleepLevel
from shared.sleep_messages import SleepCommand, SleepReply

log = logging.getLogger(__name__)
POLL_S = 0.05


class WorkerSleep:
    def __init__(
        self,
        ctx: WorkerContext,
        beat: Callable[[], Awaitable[None]],
        fail_held: Callable[[str], None],
    ) -> None:
        self.ctx = ctx
        self._beat = beat
        self._fail_held = fail_held  # fails every request held (their gateways migrate them)
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        ctx = self.ctx
        subject = ctx.subjects.sleep(ctx.config.worker_id)
        await ctx.bus.serve(subject, SleepCommand, self.on_command, self._refuse, concurrent=True)

    async def on_command(self, command: SleepCommand, headers: Headers) -> SleepReply:
        async with self._lock:
            try:
                if command.level == SleepLevel.AWAKE:
                    await self._wake_up()
                else:
                    await self._sleep(command)
            except Exception as exc:  # the engine refused: the worker stays as it was
                log.warning("sleep command %s not carried out: %s", command.level.name, exc)
                return self._reply(Outcome.UNAVAILABLE, str(exc))
            return self._reply(Outcome.OK)

    async def _sleep(self, command: SleepCommand) -> None:
        ctx, level = self.ctx, command.level
        if ctx.draining or ctx.next_role:
            raise RuntimeError("draining" if ctx.draining else "changing its role")
        if level <= ctx.sleep_level:
            return
        was = ctx.sleep_level
        ctx.sleep_level = level  # from now on: no intake, no placement
        await self._beat()
        log.info("falling asleep (level %d): draining %d requests", level, len(ctx.table))
        loop = asyncio.get_running_loop()
        give_up = loop.time() + command.drain_timeout
        while len(ctx.table) and loop.time() < give_up:
            await asyncio.sleep(POLL_S)
        if len(ctx.table):
            log.warning(
                "%d requests still held: failed, for their gateways to migrate", len(ctx.table)
            )
            self._fail_held("the worker is going to sleep")
            while len(ctx.table) and loop.time() < give_up + command.drain_timeout:
                await asyncio.sleep(POLL_S)
        try:
            await ctx.engine.sleep(int(level))
        except Exception:
            ctx.sleep_level = was
            await self._beat()
            raise
        log.info("asleep at level %d", level)
        await self._beat()

    async def _wake_up(self) -> None:
        ctx = self.ctx
        if not ctx.sleep_level:
            return
        started = asyncio.get_running_loop().time()
        await ctx.engine.wake_up()
        ctx.sleep_level = SleepLevel.AWAKE
        await self._beat()
        log.info("awake in %.2fs", asyncio.get_running_loop().time() - started)

    def _reply(self, outcome: Outcome, error: str = "") -> SleepReply:
        return SleepReply(self.ctx.config.worker_id, self.ctx.sleep_level, outcome, error)

    def _refuse(self, reason: str) -> SleepReply:
        return self._reply(Outcome.INVALID, reason)
