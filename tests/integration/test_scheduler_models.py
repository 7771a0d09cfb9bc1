"""Several models in one mesh, as the scheduler sees them (real nats-server, fake workers):
a request goes only to its model's workers, each model has its own queue, and a request with
a fallback is refused at once when its model has no worker."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from services.scheduler.registry import Registry
from shared.protocol import DecodeTask, Heartbeat, Outcome, PrefillTask
from tests.integration.scheduler_harness import FakeWorker, mesh, place, submit

SHORT = list(range(100, 110))  # decode-only: below local_prefill_tokens


@dataclass
class ModelWorker(FakeWorker):
    model: str = "m"

    async def beat(self) -> None:
        self.room = self.room_per_beat
        heartbeat = Heartbeat(
            self.worker_id, self.role, self.model, 0, 0, self.free_blocks, 200, 16
        )
        await self.bus.publish(self.subjects.heartbeat, heartbeat)


def tasks(worker: FakeWorker) -> list[str]:
    return [
        m.request.request_id for m in worker.received if isinstance(m, DecodeTask | PrefillTask)
    ]


def test_a_request_is_placed_only_on_its_models_workers(nats_server):
    a = ModelWorker("a-0", "both", model="smol-a")
    b = ModelWorker("b-0", "both", model="smol-b")

    async def scenario() -> None:
        async with mesh(nats_server.url, "mm1", [a, b]) as client:
            for i in range(4):
                for model in ("smol-a", "smol-b"):
                    ack = await place(
                        client, "mm1", replace(submit(f"{model}-{i}", SHORT), model=model)
                    )
                    assert ack.accepted, ack.error
            assert tasks(a) == [f"smol-a-{i}" for i in range(4)]
            assert tasks(b) == [f"smol-b-{i}" for i in range(4)]
            # A request of no model (the one-model mesh) takes any worker, as before.
            assert (await place(client, "mm1", submit("any", SHORT))).accepted

    asyncio.run(scenario())


def test_a_model_without_workers_refuses_at_once_with_a_fallback_else_waits(nats_server):
    a = ModelWorker("a-0", "both", model="smol-a")

    async def scenario() -> None:
        async with mesh(nats_server.url, "mm2", [a], queue_timeout=0.6) as client:
            started = time.monotonic()
            ack = await place(
                client, "mm2", replace(submit("r1", SHORT), model="gone", has_fallback=True)
            )
            assert ack.outcome == Outcome.UNAVAILABLE and "gone" in ack.error
            assert time.monotonic() - started < 0.3
            started = time.monotonic()
            ack = await place(client, "mm2", replace(submit("r2", SHORT), model="gone"))
            assert ack.outcome == Outcome.UNAVAILABLE
            assert time.monotonic() - started >= 0.6  # waited its queue timeout for a worker
            assert tasks(a) == []

    asyncio.run(scenario())


def test_each_model_has_its_own_queue(nats_server):
    a = ModelWorker("a-0", "both", model="smol-a")

    async def scenario() -> None:
        async with mesh(nats_server.url, "mm3", [a], max_queue=1, queue_timeout=2.0) as client:
            waiting = asyncio.create_task(
                place(client, "mm3", replace(submit("w", SHORT), model="smol-b"))
            )
            await asyncio.sleep(0.2)  # it waits for a worker of smol-b
            full = await place(client, "mm3", replace(submit("x", SHORT), model="smol-b"))
            assert full.outcome == Outcome.BUSY and "smol-b" in full.error
            other = await place(client, "mm3", replace(submit("y", SHORT), model="smol-a"))
            assert other.accepted, other.error
            waiting.cancel()

    asyncio.run(scenario())


def test_prefix_hashes_and_views_are_per_model():
    registry = Registry()
    for worker_id, model in (("a-0", "smol-a"), ("b-0", "smol-b")):
        registry.on_heartbeat(Heartbeat(worker_id, "both", model, 0, 0, 10, 10, 16), 0.0)
    assert [v.worker_id for v in registry.views("smol-b")] == ["b-0"]
    assert len(registry.views()) == 2
    assert registry.model_id("smol-b", "default") == "smol-b"
    assert registry.serves("smol-a") and not registry.serves("big")
