"""The launcher's NATS connection, on a thread with its own event loop, so `splitserve up`'s
main loop stays synchronous: it hears the PoolTargets on `<ns>.pool.target` (kept by a
TargetBook) and asks the scheduler for its status (`sched.status`) when told to.

The launcher connects as the `launcher` NATS user (or, under `--nats URL`, the user's own
flags), which may only subscribe to `pool.target` and ask `sched.status`. Connecting is
retried in the background until it succeeds or the link closes; every call from the main
loop returns at once (`ask_status` hands back a future that a request deadline settles),
and `close` is bounded.

The subtle rule: the book is touched on the link's thread (each target heard) and read on
the main one (`target`), so it is read and written under one lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading

from services.pool_targets import TargetBook
from shared.bus import Bus, Headers
from shared.nats_options import NatsAuth, NatsAuthError
from shared.pool_messages import PoolTarget
from shared.protocol import MeshStatus, StatusQuery
from shared.subjects import Subjects

log = logging.getLogger(__name__)
CONNECT_TRY_S = 10.0  # one connection attempt; then it is retried
STATUS_TIMEOUT_S = 2.0  # the scheduler answers sched.status at once
CLOSE_TIMEOUT_S = 3.0


class PoolLink:
    def __init__(self, url: str, auth: NatsAuth, subjects: Subjects) -> None:
        self.url, self.auth, self.subjects = url, auth, subjects
        self._book = TargetBook()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # the thread's, from start()
        self._thread: threading.Thread | None = None
        self._bus: Bus | None = None

    def start(self) -> None:
        """Start the thread and connect from it (retried in the background)."""
        self._loop = loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="pool-link", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._connect(), loop)

    def target(self) -> PoolTarget | None:
        """The target to follow (the newest accepted), or None before any."""
        with self._lock:
            return self._book.current

    @property
    def connected(self) -> bool:
        return self._bus is not None

    def ask_status(self) -> concurrent.futures.Future[MeshStatus]:
        """The scheduler's status, in a future that fails past STATUS_TIMEOUT_S (or at once
        while not connected)."""
        if self._loop is None:
            raise RuntimeError("the pool link is not started")
        return asyncio.run_coroutine_threadsafe(self._status(), self._loop)

    async def listen(self, bus: Bus) -> None:
        """Hear the targets on `bus` (connected); called on the link's thread by start()."""
        await bus.subscribe(self.subjects.pool_target, PoolTarget, self._on_target)
        self._bus = bus

    def close(self) -> None:
        """Close the connection and stop the thread, each within CLOSE_TIMEOUT_S."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if self._bus is not None:
            closing = asyncio.run_coroutine_threadsafe(self._bus.close(), loop)
            with contextlib.suppress(Exception):
                closing.result(CLOSE_TIMEOUT_S)
        settling = asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop)
        with contextlib.suppress(Exception):  # a connect in progress ends before the loop does
            settling.result(CLOSE_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    async def _connect(self) -> None:
        while True:
            try:
                bus = await Bus.connect(
                    self.url, "launcher", connect_timeout=CONNECT_TRY_S, auth=self.auth
                )
                break
            except ConnectionError as exc:
                log.warning("pool targets not followed yet: %s; trying again", exc)
            except NatsAuthError as exc:  # will not work however often it is tried
                log.error("pool targets not followed: %s", exc)
                return
        await self.listen(bus)
        log.info("following pool targets on %s", self.subjects.pool_target)

    async def _on_target(self, target: PoolTarget, headers: Headers) -> None:
        with self._lock:
            accepted = self._book.offer(target)
        if not accepted:
            log.info("pool target %s #%d: not newer, ignored", target.publisher, target.seq_no)

    async def _status(self) -> MeshStatus:
        if self._bus is None:
            raise ConnectionError("not connected to NATS yet")
        status = self.subjects.status
        return await self._bus.request(status, StatusQuery(), MeshStatus, STATUS_TIMEOUT_S)


async def _cancel_the_rest() -> None:
    """Cancel every other task of this loop and wait for them to end."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
