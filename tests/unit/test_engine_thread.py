"""`EngineThread.stop`: a built engine's thread is joined; one still building its engine
(weights loading) is left behind at once, and `still_loading` says so, so a worker told to
stop while it loads stops then and not once its model is in memory."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from services.worker.engine_thread import EngineThread, still_loading
from shared.engine.stats import KVCacheEvents


class IdleEngine:
    """Just what the thread asks of an engine that holds no request."""

    def has_unfinished_requests(self) -> bool:
        return False

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=0)

    def take_kv_events(self) -> KVCacheEvents:
        return KVCacheEvents()


def make_thread(build) -> EngineThread:
    return EngineThread(build, on_step=lambda engine, report: None, on_fatal=lambda exc: None)


def test_stop_joins_the_thread_of_a_built_engine():
    thread = make_thread(IdleEngine)

    async def main() -> None:
        await thread.start()
        await thread.stop()

    asyncio.run(main())
    assert not thread.alive
    assert not still_loading()


def test_stop_leaves_a_thread_still_loading_its_engine_at_once():
    loaded = threading.Event()

    def slow_build() -> IdleEngine:
        loaded.wait(30)
        return IdleEngine()

    thread = make_thread(slow_build)

    async def main() -> float:
        starting = asyncio.create_task(thread.start())
        await asyncio.sleep(0.1)
        starting.cancel()  # what a SIGTERM during start-up does (service_loop)
        began = time.monotonic()
        await thread.stop()
        return time.monotonic() - began

    try:
        assert asyncio.run(main()) < 1
        assert thread.alive and still_loading()
    finally:
        loaded.set()
    deadline = time.monotonic() + 10
    while thread.alive:  # built at last, it finds the stop queued and ends
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not still_loading()
