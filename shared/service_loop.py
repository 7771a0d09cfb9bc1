"""The run-until-signal loop every service process runs, written once.

`run_until_signal(start, shutdown, failed)`: SIGTERM and SIGINT set an event; `start()`
runs, then the loop waits for that event (or for `failed`, which a service sets when it
can no longer serve, e.g. a worker whose engine died), and `shutdown()` always runs last.
A signal that comes while `start()` still runs (a model loading) cancels it: a service
stops when told to, not once it is ready.
`run(main)` runs a coroutine on uvloop when it is installed, else on asyncio's loop, with
SIGUSR1 set to print every thread's stack to stderr: `splitserve up` sends it to a child
that ignores SIGTERM before killing it, so a hang leaves where it hung in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
STACK_DUMP_SIGNAL = signal.SIGUSR1
log = logging.getLogger(__name__)


async def run_until_signal(
    start: Callable[[], Awaitable[None]],
    shutdown: Callable[[], Awaitable[None]],
    failed: asyncio.Event | None = None,
) -> bool:
    """Start, serve until a signal or `failed`, shut down; True when `failed` ended it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.ensure_future(start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.warning("stopping before start-up finished")
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return False
        stopped.cancel()
        starting.result()  # a failed start raises here (shutdown still runs)
        waits = [asyncio.ensure_future(stop.wait())]
        if failed is not None:
            waits.append(asyncio.ensure_future(failed.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if failed is not None and failed.is_set():
            log.error("stopping: the service failed")
            return True
        return False
    finally:
        try:
            await shutdown()
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)


def log_to_stderr(level: str) -> None:
    """The services' log lines: time, level, logger, message; `level` as the flag gives it."""
    format_ = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=format_)


def run(main: Coroutine[Any, Any, T]) -> T:
    """`main` to completion on uvloop when it is installed, else on asyncio's own loop."""
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
