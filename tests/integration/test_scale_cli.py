"""`splitserve scale` over a real nats-server against a stand-in scheduler (its status) and a
stand-in launcher (which "starts" the workers a target asks for): the whole target it
publishes, success once the status shows the count, and failure, with why, when no
scheduler answers or the count is not reached in time."""

from __future__ import annotations

import asyncio
import time

from services.scale_cli import ScaleCommand, scale
from shared.bus import Bus
from shared.config import CommonConfig
from shared.pool_messages import PoolTarget
from shared.protocol import Heartbeat, MeshStatus, StatusQuery, WorkerStatus
from shared.subjects import Subjects


def status_of(roles: list[str]) -> MeshStatus:
    beats = [Heartbeat(f"w{i}", role, "m", 0, 0, 10, 10, 16) for i, role in enumerate(roles)]
    return MeshStatus([WorkerStatus(b, 0.0) for b in beats], 0, 0, 0)


def command(nats_url: str, **fields) -> ScaleCommand:
    return ScaleCommand(common=CommonConfig(nats_url=nats_url, namespace="scale"), **fields)


async def stand_ins(url: str, follows: bool) -> tuple[Bus, list[PoolTarget]]:
    """A scheduler answering with `workers`, and a launcher that makes the workers a target
    wants appear (when `follows`)."""
    subjects = Subjects("scale")
    bus = await Bus.connect(url, "stand-in")
    workers = ["prefill", "decode"]
    heard: list[PoolTarget] = []

    async def on_status(query: StatusQuery, headers) -> MeshStatus:
        return status_of(workers)

    async def on_target(target: PoolTarget, headers) -> None:
        heard.append(target)
        if follows:
            workers[:] = [r for r in ("prefill", "decode", "both") for _ in range(target.wanted(r))]

    await bus.serve(subjects.status, StatusQuery, on_status, lambda why: status_of([]))
    await bus.subscribe(subjects.pool_target, PoolTarget, on_target)
    return bus, heard


def test_scale_publishes_the_whole_target_and_waits_for_the_count(nats_server):
    async def main() -> None:
        bus, heard = await stand_ins(nats_server.url, follows=True)
        before = time.time_ns()
        try:
            ok, message = await scale(command(nats_server.url, role="decode", replicas=3, wait=10))
        finally:
            await bus.close()
        assert (ok, message) == (True, "3 decode worker(s) serving")
        (target,) = heard
        assert (target.publisher, target.model, target.reason) == (
            "scale",
            "",
            "asked by splitserve scale",
        )
        assert (target.prefill, target.decode, target.both) == (1, 3, 0)  # the others as live
        assert target.seq_no >= before  # from the clock: a later command wins

    asyncio.run(main())


def test_scale_fails_with_why_when_the_count_is_not_reached_or_nobody_answers(nats_server):
    async def main() -> None:
        bus, heard = await stand_ins(nats_server.url, follows=False)
        try:
            ok, message = await scale(command(nats_server.url, role="both", replicas=2, wait=1.0))
        finally:
            await bus.close()
        assert not ok and message.startswith("0 both worker(s) after 1.0 s, not 2")
        assert len(heard) == 1
        ok, message = await scale(command(nats_server.url, role="both", replicas=2, wait=1.0))
        assert (ok, message) == (False, "no scheduler answers on scale.sched.status")

    asyncio.run(main())
