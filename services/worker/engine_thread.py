"""The engine in its own thread: the only code that touches the (synchronous) `LLMEngine`.

Commands come in through a queue as functions of the engine; each one's result (or
exception) resolves an asyncio future on the caller's loop. Between commands the thread
steps the engine while it has work and hands every step's outputs back to the loop with
`call_soon_threadsafe`; when idle it blocks on the queue with a short timeout.

A step can take seconds on a CPU (a long prefill chunk), and a command waits for the step in
progress. What must never wait — the heartbeat — reads `observed` instead: `observe(engine)`
taken by the thread after every step and every batch of commands.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT = 0.05  # seconds the idle thread waits for a command

Command = tuple[Callable[[LLMEngine], Any], asyncio.Future]


class EngineThread:
    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[list[RequestOutput], float], None],
        observe: Callable[[LLMEngine], Any],
    ) -> None:
        """`on_outputs(outputs, step_started)` runs on the loop; `step_started` is the
        step's start in Unix seconds (the end of the requests' queueing, for telemetry)."""
        self.config = config
        self.on_outputs = on_outputs
        self.observe = observe
        self.observed: Any = None  # the latest observe(engine); None until the engine is built
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None  # why the thread stopped, if it failed

    async def start(self) -> None:
        """Build the engine inside its thread (weights load there) and start stepping."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = self._loop.create_future()
        self._commands.put((lambda engine: None, ready))
        self._thread.start()
        await ready

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` in the engine thread and return its result."""
        assert self._loop is not None, "start() first"
        if self.error is not None:
            raise RuntimeError(f"the engine thread has stopped: {self.error}")
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put((fn, future))
        return await future

    async def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)

    def _run(self) -> None:
        try:
            engine = LLMEngine(self.config)
        except Exception as exc:
            self._fail(exc)
            return
        try:
            self.observed = self.observe(engine)
            while self._apply_queued(engine, block=not engine.has_unfinished_requests()):
                self.observed = self.observe(engine)
                if engine.has_unfinished_requests():
                    started = time.time()
                    outputs = engine.step()
                    self.observed = self.observe(engine)
                    if outputs:
                        assert self._loop is not None
                        self._loop.call_soon_threadsafe(self.on_outputs, outputs, started)
        except Exception as exc:  # an engine bug: fail every caller rather than hang them
            log.exception("engine thread failed")
            self._fail(exc)

    def _apply_queued(self, engine: LLMEngine, block: bool) -> bool:
        """Apply every queued command, first waiting up to IDLE_WAIT for one when `block`.
        False when told to stop."""
        try:
            command = (
                self._commands.get(timeout=IDLE_WAIT) if block else self._commands.get_nowait()
            )
            while command is not None:
                self._apply(engine, command)
                command = self._commands.get_nowait()
            return False
        except queue.Empty:
            return True

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                self._resolve(command[1], None, exc)

    def _apply(self, engine: LLMEngine, command: Command) -> None:
        fn, future = command
        try:
            result = fn(engine)
        except Exception as exc:
            self._resolve(future, None, exc)
        else:
            self._resolve(future, result, None)

    def _resolve(self, future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
        def settle() -> None:
            if future.done():  # the caller gave up (cancelled)
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(settle)
