"""The engine in its own thread: the only code that calls the (synchronous) `LLMEngine`.

Commands come in through a queue as functions of the engine. Between commands the thread
steps the engine; each step's `StepOutput` (its outputs and the engine's transitions) goes
back to the event loop with `call_soon_threadsafe`. The thread sleeps on the queue — using
no CPU — whenever stepping would change nothing: the engine holds no work, or its last step
scheduled no token (every waiting request lacks blocks; only a command — a release, an
abort, an import — can free them). After every step and every batch of commands it snapshots
the engine's counters (`stats`) and gathers its prefix-cache events, which the loop reads
without waiting; a step that commands came in during is snapshot once they are applied, so
prompts that arrived meanwhile count as waiting (a prefill worker's backlog) from the step's
end, as does a prompt that one step prefilled only in part.

With a `CoreLease` (core_lease.py), each step runs with one torch thread per core it holds:
its own, and those of the machine's idle workers. Each step is timed (the engine's own call,
not the wait for cores) into a `StepTimer` (step_costs.py): `timer.current` is its costs.

The thread shares the GIL with the event loop. A step takes it back after each native call
(a layer, the LM head), and a thread that wants the GIL waits for the holder to let it go at
most the interpreter's switch interval, 5 ms by default: with the loop busy (a burst of
arrivals, tokens going out) a step could lose milliseconds a layer. `start()` shortens the
interval for the process to `GIL_SWITCH_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from services.worker.core_lease import CoreLease
from services.worker.step_costs import StepTimer
from shared.engine.engine import LLMEngine
from shared.engine.outputs import StepOutput
from shared.engine.stats import EngineStats, KVCacheEvents, KVEventLog

log = logging.getLogger(__name__)
THREAD_NAME = "engine"
# A tenth of Python's default: a step waits less for the GIL behind a busy loop, which
# shortens a burst's tail TTFT; shorter did no better (docs/engine-speed.md).
GIL_SWITCH_INTERVAL_S = 0.0005


def still_loading() -> bool:
    """Whether an engine thread `stop()` left behind is still building its engine."""
    return any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


T = TypeVar("T")


@dataclass(slots=True)
class _Command:
    fn: Callable[[LLMEngine], Any]
    on_done: Callable[[Any, BaseException | None], None]  # called in the engine thread


class EngineThread:
    def __init__(
        self,
        build: Callable[[], LLMEngine],
        on_step: Callable[[StepOutput, float], None],
        on_fatal: Callable[[BaseException], None],
        lease: CoreLease | None = None,
    ) -> None:
        """`on_step(step, step_started)` runs on the loop after a step that did something
        (`step_started` in Unix seconds); `on_fatal` runs on the loop when the thread dies.
        `lease` sizes each step's threads."""
        self.build = build
        self.lease = lease
        self.on_step = on_step
        self.on_fatal = on_fatal
        self.stats: EngineStats | None = None  # None until the engine is built
        self.timer = StepTimer()  # each step's seconds and shape (the engine thread's)
        self.error: BaseException | None = None  # why the thread stopped, if it failed
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events = _SharedEventLog()
        self._built = False  # set by the thread once `build()` returned

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "start() first"
        return self._loop

    async def start(self) -> None:
        """Build the engine inside its thread (weights load there) and start stepping; a
        failed build raises its own error here."""
        self._loop = asyncio.get_running_loop()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        ready = self._submit(lambda engine: None)  # queued first: answered once it is built
        self._thread.start()
        await ready

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` between steps and return its result (or raise its error)."""
        if self.error is not None:
            raise RuntimeError(f"the engine has stopped: {self.error}")
        return await self._submit(fn)

    def _submit(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        loop = self._loop
        assert loop is not None, "start() first"
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, exc: BaseException | None) -> None:
            def resolve() -> None:
                if future.done():  # the caller gave up (cancelled)
                    return
                if exc is not None:
                    future.set_exception(exc)
                else:
                    future.set_result(result)

            self.to_loop(resolve)

        self._commands.put(_Command(fn, settle))
        return future

    def post(self, fn: Callable[[LLMEngine], Any], on_error: Callable[[BaseException], None]):
        """Queue `fn(engine)` without waiting; `on_error(exc)` runs on the loop if it raises.
        Dropped once the engine has stopped (`on_fatal` speaks for every request then)."""
        assert self._loop is not None, "start() first"

        def settle(result: Any, exc: BaseException | None) -> None:
            if exc is not None and self.error is None:
                self.to_loop(on_error, exc)

        if self.error is None:
            self._commands.put(_Command(fn, settle))

    def to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call `fn(*args)` on the loop, from any thread. Once the loop is closed (a thread
        left loading at shutdown) there is nobody to tell: nothing happens."""
        assert self._loop is not None, "start() first"
        with contextlib.suppress(RuntimeError):  # "Event loop is closed"
            self._loop.call_soon_threadsafe(fn, *args)

    def take_kv_events(self) -> KVCacheEvents:
        return self._events.take()

    async def stop(self) -> None:
        """Stop stepping and wait for the thread. One still building the engine (weights
        loading) is left behind: it is a daemon, so it ends with the process."""
        if not self._thread.is_alive():
            return
        self._commands.put(None)
        if not self._built and self.error is None:
            log.warning("the engine was still loading; not waiting for it")
            return
        await asyncio.to_thread(self._thread.join)

    def _run(self) -> None:
        began = time.monotonic()
        try:
            engine = self.build()
        except Exception as exc:
            self._fail(exc)
            return
        self._built = True
        log.info("engine built in %.1f s", time.monotonic() - began)
        try:
            stalled = False
            while self._apply_commands(engine, stalled or not engine.has_unfinished_requests()):
                if not engine.has_unfinished_requests():
                    continue
                step_started = time.time()
                step = self._step(engine)
                if step is None:  # commands came while it waited for cores: they go first
                    continue
                stalled = engine.last_step_num_tokens == 0
                if self._commands.empty():  # else once they are applied: prompts that came
                    self._observe(engine)  # during the step are a backlog, not none at all
                if step.outputs or step.started:  # after the counters: they agree with it
                    self.to_loop(self.on_step, step, step_started)
        except Exception as exc:  # an engine bug: fail every caller rather than hang them
            log.exception("engine thread failed")
            self._fail(exc)
        finally:
            engine.close()
            if self.lease is not None:
                self.lease.close()

    def _step(self, engine: LLMEngine) -> StepOutput | None:
        """One step on the cores the lease gives; None, without a step, when commands came
        while the lease waited on another worker (a reservation must not wait out a backlog:
        the prompt it is for is what the prefill worker needs next)."""
        if self.lease is None:
            return self._timed_step(engine)
        cores = self.lease.acquire(interrupted=lambda: not self._commands.empty())
        if cores is None:
            return None
        try:
            if cores != torch.get_num_threads():
                torch.set_num_threads(cores)
            return self._timed_step(engine)
        finally:
            self.lease.release()

    def _timed_step(self, engine: LLMEngine) -> StepOutput:
        began = time.perf_counter()
        step = engine.run_step()
        seconds = time.perf_counter() - began
        self.timer.observe(seconds, step.num_prompt_tokens, step.num_decode_rows)
        engine.observe_costs(self.timer.current)  # the tier weighs loads by the prefill rate
        return step

    def _apply_commands(self, engine: LLMEngine, wait: bool) -> bool:
        """Apply every queued command, first sleeping until one comes when `wait`.
        False when told to stop."""
        if not wait and self._commands.empty():
            return True
        if wait and self.lease is not None:
            self.lease.idle()  # nothing to step: the other workers may use this core
        command = self._commands.get()  # blocks only when `wait`: else one is queued
        while command is not None:
            try:
                result = command.fn(engine)
            except Exception as exc:
                command.on_done(None, exc)
            else:
                command.on_done(result, None)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._observe(engine)
                return True
        return False

    def _observe(self, engine: LLMEngine) -> None:
        self.stats = engine.stats()
        self._events.add(engine.take_kv_events())
        if self.lease is not None:
            # A prefill worker's running prompts are still prefilling: each leaves the running
            # batch with its first token (held until its KV is exported).
            self.lease.set_backlog(self.stats.num_waiting + self.stats.num_running > 0)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None:
                command.on_done(None, exc)
        if self._loop is not None:
            self.to_loop(self.on_fatal, exc)


class _SharedEventLog:
    """`KVEventLog`s (the pool's, the second tier's) the engine thread fills after each step
    and the loop takes from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = KVEventLog()
        self._tier = KVEventLog()

    def add(self, events: KVCacheEvents) -> None:
        if not events:
            return
        with self._lock:
            _apply(self._pool, events.stored, events.removed)
            _apply(self._tier, events.tier_stored, events.tier_removed)

    def take(self) -> KVCacheEvents:
        with self._lock:
            events, tier = self._pool.take(), self._tier.take()
        events.tier_stored, events.tier_removed = tier.stored, tier.removed
        return events


def _apply(log: KVEventLog, stored: list[int], removed: list[int]) -> None:
    for block_hash in removed:
        log.removed(block_hash)
    for block_hash in stored:
        log.stored(block_hash)
