"""`run_until_signal`: a signal ends the service (even one still starting), a failure ends
it and says so, and the shutdown coroutine runs in every case, after `start`. `run` makes
SIGUSR1 print every thread's stack."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from shared.service_loop import run, run_until_signal


class Service:
    def __init__(self, fail_start: bool = False, hang_start: bool = False) -> None:
        self.calls: list[str] = []
        self.failed = asyncio.Event()
        self.fail_start = fail_start
        self.hang_start = hang_start

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("no NATS")
        if self.hang_start:  # a model that takes forever to load
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.calls.append("start cancelled")
                raise

    async def shutdown(self) -> None:
        self.calls.append("shutdown")


def later(action) -> None:
    asyncio.get_running_loop().call_later(0.05, action)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_service_in_order(sig):
    service = Service()

    async def main() -> bool:
        later(lambda: os.kill(os.getpid(), sig))
        return await run_until_signal(service.start, service.shutdown, service.failed)

    assert run(main()) is False
    assert service.calls == ["start", "shutdown"]


def test_a_failure_stops_the_service_and_is_reported():
    service = Service()

    async def main() -> bool:
        later(service.failed.set)
        return await run_until_signal(service.start, service.shutdown, service.failed)

    assert run(main()) is True
    assert service.calls == ["start", "shutdown"]


def test_shutdown_runs_when_start_fails_and_the_handlers_are_removed():
    service = Service(fail_start=True)

    async def main() -> None:
        await run_until_signal(service.start, service.shutdown)

    with pytest.raises(RuntimeError, match="no NATS"):
        run(main())
    assert service.calls == ["start", "shutdown"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_signal_during_start_cancels_it_and_shutdown_still_runs():
    service = Service(hang_start=True)

    async def main() -> bool:
        later(lambda: os.kill(os.getpid(), signal.SIGTERM))
        return await run_until_signal(service.start, service.shutdown, service.failed)

    began = time.monotonic()
    assert run(main()) is False
    assert time.monotonic() - began < 5
    assert service.calls == ["start", "start cancelled", "shutdown"]


HUNG_SERVICE = """
import asyncio, sys, time
from shared.service_loop import run
async def main():
    print("ready", flush=True)
    time.sleep(30)  # blocks the loop, as a stuck C call would
run(main())
"""


def test_sigusr1_prints_every_threads_stack_while_the_loop_is_blocked():
    child = subprocess.Popen(
        [sys.executable, "-c", HUNG_SERVICE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert child.poll() is None  # it printed and went on
    finally:
        child.kill()
    stderr = child.communicate(timeout=10)[1]
    assert "Current thread" in stderr or "Thread 0x" in stderr, stderr
    # in main: on its sleep (line 6), or still on the print's line when the signal came first
    assert re.search(r'File "<string>", line [56] in main', stderr), stderr
