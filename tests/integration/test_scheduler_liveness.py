"""Liveness over a real nats-server with fake workers (scheduler_harness.py): a worker whose
heartbeats stop is probed before it is lost. One that answers (a busy machine) is never
lost and nothing migrates; one whose connection is gone is lost at once; one that does not
answer by the probe deadline (frozen), or whose answer comes from another process (a
restart under the same id), is lost with the requests placed on it."""

from __future__ import annotations

import asyncio
import time

from shared.bus import Bus, Headers
from shared.protocol import WorkerLost
from shared.subjects import Subjects
from tests.integration.scheduler_harness import FakeWorker, mesh, place, status, submit, until


async def record_lost(client: Bus, namespace: str) -> list[WorkerLost]:
    lost: list[WorkerLost] = []

    async def on_event(message: WorkerLost, headers: Headers) -> None:
        lost.append(message)

    await client.subscribe(Subjects(namespace).events, WorkerLost, on_event)
    await client.nc.flush()
    return lost


async def registered(client: Bus, namespace: str) -> list[str]:
    return [w.heartbeat.worker_id for w in (await status(client, Subjects(namespace))).workers]


def test_a_silent_worker_that_answers_its_probe_is_not_lost(nats_server):
    async def scenario() -> None:
        busy = FakeWorker("d1", "both", probe_delay=0.3)  # answers, late but in time
        async with mesh(nats_server.url, "lv1", [busy], probe_timeout=1.0) as client:
            assert (await place(client, "lv1", submit("r1"))).decode_worker == "d1"
            lost = await record_lost(client, "lv1")
            busy.silence()
            await until(lambda: busy.probes >= 2, timeout=6)  # silent past the timeout, twice
            assert lost == []
            assert await registered(client, "lv1") == ["d1"]
            busy.resume()
            assert (await place(client, "lv1", submit("r2"))).decode_worker == "d1"
            assert lost == []

    asyncio.run(scenario())


def test_a_worker_that_does_not_answer_by_the_probe_deadline_is_lost(nats_server):
    async def scenario() -> None:
        frozen = FakeWorker("d1", "both", probe_delay=60.0)
        async with mesh(nats_server.url, "lv2", [frozen], probe_timeout=1.0) as client:
            assert (await place(client, "lv2", submit("r1"))).decode_worker == "d1"
            lost = await record_lost(client, "lv2")
            frozen.silence()
            silent_at = time.monotonic()
            await until(lambda: frozen.probes == 1, timeout=3)
            assert lost == [] and await registered(client, "lv2") == ["d1"]  # suspect only
            await until(lambda: bool(lost), timeout=5)
            # heartbeat timeout (1 s) + probe timeout (1 s), give or take a beat and a sweep
            assert time.monotonic() - silent_at > 1.5
            assert lost == [WorkerLost("d1", ["r1"])]
            assert await registered(client, "lv2") == []

    asyncio.run(scenario())


def test_a_suspect_worker_gets_no_new_work(nats_server):
    async def scenario() -> None:
        frozen = FakeWorker("d1", "both", probe_delay=60.0)
        other = FakeWorker("d2", "both", free_blocks=50)
        async with mesh(nats_server.url, "lv3", [frozen, other], probe_timeout=3.0) as client:
            frozen.silence()
            await until(lambda: frozen.probes == 1, timeout=3)
            assert (await place(client, "lv3", submit("r1"))).decode_worker == "d2"
            assert not frozen.received

    asyncio.run(scenario())


def test_an_answer_from_another_process_under_the_same_id_loses_the_old_one(nats_server):
    async def scenario() -> None:
        worker = FakeWorker("d1", "both", probe_delay=0.0)
        async with mesh(nats_server.url, "lv4", [worker], probe_timeout=1.0) as client:
            assert (await place(client, "lv4", submit("r1"))).decode_worker == "d1"
            lost = await record_lost(client, "lv4")
            worker.silence()
            worker.epoch = 2  # what answers the probe is a new process
            await until(lambda: bool(lost), timeout=4)
            assert lost == [WorkerLost("d1", ["r1"])]

    asyncio.run(scenario())
