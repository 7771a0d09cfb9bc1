"""The scheduler's probe verdicts (services/scheduler/liveness.py) over a stand-in bus:
answered by the same process → alive; no responders, no answer, or another process →
lost, once; a probe that failed while the scheduler itself was disconnected → no verdict."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from nats.errors import ConnectionClosedError, NoRespondersError

from services.scheduler.liveness import Liveness
from services.scheduler.registry import Registry, WorkerState
from shared.liveness_messages import ProbeAck
from shared.protocol import Heartbeat
from shared.subjects import Subjects


class StandInBus:
    def __init__(self, answer: ProbeAck | Exception, connected: bool = True) -> None:
        self.answer = answer
        self.nc = SimpleNamespace(is_connected=connected)

    async def request(self, subject, message, reply_type, timeout):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def verdict(answer: ProbeAck | Exception, connected: bool = True) -> tuple[list[str], Registry]:
    registry = Registry(heartbeat_timeout=3.0)
    beat = Heartbeat("w1", "decode", "m", 0, 0, 10, 10, 16, epoch=7)
    registry.on_heartbeat(beat, now=100.0)
    lost: list[str] = []

    async def on_lost(state: WorkerState, why: str) -> None:
        lost.append(why)

    liveness = Liveness(StandInBus(answer, connected), Subjects(), registry, 1.0, on_lost)  # type: ignore[arg-type]
    (suspect,) = registry.silent(now=104.0)
    asyncio.run(liveness.probe("w1", suspect.epoch, 104.0))
    return lost, registry


def test_an_answer_from_the_same_process_keeps_it() -> None:
    lost, registry = verdict(ProbeAck("w1", 7))
    assert lost == [] and [v.worker_id for v in registry.views()] == ["w1"]


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (NoRespondersError(), "connection is gone"),
        (TimeoutError(), "no answer to a probe"),
        (ProbeAck("w1", 8), "another process (epoch 8)"),
    ],
)
def test_lost_when(answer, why: str) -> None:
    lost, registry = verdict(answer)
    assert len(lost) == 1 and why in lost[0]
    assert "w1" not in registry


def test_no_verdict_while_the_scheduler_is_disconnected() -> None:
    lost, registry = verdict(ConnectionClosedError(), connected=False)
    assert lost == [] and "w1" in registry
    assert [s.heartbeat.worker_id for s in registry.silent(now=105.0)] == ["w1"]  # again
