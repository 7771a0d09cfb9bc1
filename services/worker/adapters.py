"""A worker's answer to `AdapterCommand`s (shared/lora_messages.py): load or unload a LoRA
adapter in its engine, between steps, and announce the change with a heartbeat at once.

The one rule: a bad adapter is an answer (INVALID with the engine's reason), never a
failure of the worker: it serves on with the adapters it had.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from opentelemetry.context import Context

from services.worker.context import WorkerContext
from services.worker.role_change import serve
from shared.engine.errors import EngineError
from shared.lora_messages import AdapterAction, AdapterAnswer, AdapterCommand
from shared.protocol import Outcome

log = logging.getLogger(__name__)


class AdapterCommands:
    def __init__(self, ctx: WorkerContext, beat: Callable[[], Awaitable[None]]) -> None:
        self.ctx = ctx
        self.beat = beat  # publishes a heartbeat now

    async def start(self) -> None:
        ctx = self.ctx
        subject = ctx.subjects.worker_adapters(ctx.config.worker_id)
        await serve(ctx.bus, subject, AdapterCommand, self.on_command, self._refuse)

    async def on_command(self, command: AdapterCommand, parent: Context) -> AdapterAnswer:
        engine, wid = self.ctx.engine, self.ctx.config.worker_id
        try:
            if command.action == AdapterAction.LOAD:
                await engine.load_adapter(command.name, command.path)
            else:
                await engine.unload_adapter(command.name)
        except EngineError as exc:
            log.warning("adapter %s %s refused: %s", command.action.name, command.name, exc)
            return AdapterAnswer(wid, Outcome.INVALID, str(exc))
        log.info("adapter %s: %s", command.name, command.action.name.lower())
        await self.beat()
        return AdapterAnswer(wid, Outcome.OK)

    def _refuse(self, reason: str) -> AdapterAnswer:
        return AdapterAnswer(self.ctx.config.worker_id, Outcome.INVALID, reason)
