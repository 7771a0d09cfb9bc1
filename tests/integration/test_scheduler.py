"""The scheduler over a real nats-server, with fake workers (tests/integration/
scheduler_harness.py): placement by prefix overlap, decode-only for short prompts,
reservation fallback, refusals, worker loss, status; and the scheduler's modules never
import torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from services.scheduler.placement import RELEASED
from shared.bus import Headers
from shared.protocol import (
    Cancel,
    DecodeTask,
    Outcome,
    PrefillTask,
    Reserve,
    SubmitAck,
    WorkerLost,
)
from shared.subjects import Subjects
from tests.integration.scheduler_harness import (
    HASHES,
    PROMPT,
    FakeWorker,
    mesh,
    place,
    record_cancels,
    status,
    submit,
    until,
)


def test_prefill_by_overlap_short_prompt_decode_only_and_status(nats_server):
    async def scenario() -> None:
        p1 = FakeWorker("p1", "prefill", cached=HASHES[:1])
        p2 = FakeWorker("p2", "prefill", cached=HASHES[:3])
        d1 = FakeWorker("d1", "decode", num_cached_blocks=1)
        async with mesh(nats_server.url, "s1", [p1, p2, d1]) as client:
            ack = await place(client, "s1", submit("r1"))
            assert ack == SubmitAck("r1", Outcome.OK, prefill_worker="p2", decode_worker="d1")
            assert [type(m) for m in d1.received] == [Reserve]
            (task,) = p2.received
            assert isinstance(task, PrefillTask)
            assert (task.decode_worker, task.skip_blocks) == ("d1", 1)
            assert task.request.prompt_token_ids == PROMPT

            short = await place(client, "s1", submit("r2", PROMPT[:10]))
            assert short == SubmitAck("r2", Outcome.OK, decode_worker="d1")
            assert isinstance(d1.received[-1], DecodeTask)

            mesh_status = await status(client, Subjects("s1"))
            assigned = {w.heartbeat.worker_id: w.assigned for w in mesh_status.workers}
            assert assigned == {"d1": ["r1", "r2"], "p1": [], "p2": ["r1"]}
            assert (mesh_status.admitted, mesh_status.rejected) == (2, 0)

    asyncio.run(scenario())


def test_refused_reservation_falls_back_and_failed_prefill_frees_it_and_waits(nats_server):
    async def scenario() -> None:
        d1 = FakeWorker("d1", "decode", free_blocks=150, reserve=Outcome.UNAVAILABLE)
        d2 = FakeWorker("d2", "decode", free_blocks=50)
        p1 = FakeWorker("p1", "prefill")
        async with mesh(nats_server.url, "s2", [d1, d2, p1], queue_timeout=0.5) as client:
            ack = await place(client, "s2", submit("r1"))
            assert (ack.outcome, ack.decode_worker, ack.prefill_worker) == (Outcome.OK, "d2", "p1")
            assert len(d1.received) == 1  # asked first (more free blocks), refused

            cancels = await record_cancels(client, "s2")
            p1.task = Outcome.FAILED
            refused = await place(client, "s2", submit("r2"))
            assert refused.outcome == Outcome.UNAVAILABLE and refused.retry_after > 0
            assert "no worker had room" in refused.error and "p1 failed" in refused.error
            prefills = [m for m in p1.received if m.request.request_id == "r2"]
            assert len(prefills) >= 2  # tried again while it waited
            await asyncio.sleep(0.2)
            # Every try freed its reservation on d2, without cancelling the request itself.
            assert {(c.request_id, c.reason) for c in cancels} == {("r2", RELEASED)}
            assert len(cancels) == len(prefills)

    asyncio.run(scenario())


def test_no_workers_waits_then_refuses_and_a_full_queue_refuses_at_once(nats_server):
    async def scenario() -> None:
        async with mesh(nats_server.url, "s3", [], queue_timeout=0.3) as client:
            ack = await place(client, "s3", submit("r1"))
            assert ack.outcome == Outcome.UNAVAILABLE and ack.retry_after == 1.0
            assert ack.error == "no worker had room for 0 s: no worker for role decode"

        full = FakeWorker("d1", "both", busy_answers=10**6)
        async with mesh(nats_server.url, "s4", [full], max_queue=1) as client:
            waiting = asyncio.create_task(place(client, "s4", submit("r1")))
            await until(lambda: len(full.received) > 0)
            started = time.monotonic()
            refused = await place(client, "s4", submit("r2"))
            assert time.monotonic() - started < 0.5
            assert refused.outcome == Outcome.BUSY and refused.retry_after > 0
            assert "busy" in refused.error and not waiting.done()
            await client.publish(Subjects("s4").cancel, Cancel("r1", "gateway"))
            assert (await waiting).outcome == Outcome.UNAVAILABLE

    asyncio.run(scenario())


def test_silent_worker_is_lost_with_its_requests(nats_server):
    async def scenario() -> None:
        d1 = FakeWorker("d1", "both")
        d2 = FakeWorker("d2", "both", free_blocks=2)  # too small for the prompt
        async with mesh(nats_server.url, "s5", [d1, d2]) as client:
            for request_id in ("r1", "r2", "r3"):
                assert (await place(client, "s5", submit(request_id))).decode_worker == "d1"
            await client.publish(Subjects("s5").cancel, Cancel("r2"))
            lost: list[WorkerLost] = []
            arrived = asyncio.Event()

            async def on_event(message: WorkerLost, headers: Headers) -> None:
                lost.append(message)
                arrived.set()

            await client.subscribe(Subjects("s5").events, WorkerLost, on_event)
            await client.nc.flush()
            d1.beating = False
            await asyncio.wait_for(arrived.wait(), 5)
            assert lost == [WorkerLost("d1", ["r1", "r3"])]
            workers = (await status(client, Subjects("s5"))).workers
            assert [w.heartbeat.worker_id for w in workers] == ["d2"]

    asyncio.run(scenario())


def test_scheduler_never_imports_torch():
    code = (
        "import sys, argparse\n"
        "import services.scheduler.service, services.scheduler.cli as c\n"
        "p = argparse.ArgumentParser(); c.add_parser(p.add_subparsers())\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
