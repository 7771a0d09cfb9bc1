"""`run_until_signal`: a signal ends the service, a failure ends it and says so, and the
shutdown coroutine runs in every case, after `start`."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shared.service_loop import run, run_until_signal


class Service:
    def __init__(self, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.failed = asyncio.Event()
        self.fail_start = fail_start

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("no NATS")

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
