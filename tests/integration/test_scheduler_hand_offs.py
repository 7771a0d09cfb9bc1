"""A failed KV hand-off over a real nats-server (fake workers: tests/integration/
scheduler_harness.py; issue 60 case 5): the migrated attempt of a request whose KV never
reached its decode worker prefills there, so does the next request on that pair, and the
scheduler counts both in `splitserve_scheduler_kv_fallbacks_total{reason}`."""

from __future__ import annotations

import asyncio

from services.scheduler.service import SchedulerService
from shared.protocol import DecodeTask, PrefillTask, Reserve
from tests.integration.scheduler_harness import FakeWorker, mesh, place, submit


def fallbacks(service: SchedulerService, reason: str) -> float:
    name = "splitserve_scheduler_kv_fallbacks_total"
    return service.metrics.registry.get_sample_value(name, {"reason": reason}) or 0.0


def test_a_request_whose_kv_never_arrived_prefills_where_it_decodes(nats_server):
    async def scenario() -> None:
        p1, d1 = FakeWorker("p1", "prefill"), FakeWorker("d1", "decode")
        services: list[SchedulerService] = []
        async with mesh(nats_server.url, "ho1", [p1, d1], services) as client:
            first = await place(client, "ho1", submit("r1"))
            assert (first.prefill_worker, first.decode_worker) == ("p1", "d1")
            # The prefill worker streamed the first token; the KV never came (the gateway's
            # stall timeout migrated it): attempt 1 with that one token delivered.
            migrated = submit("r1~1")
            migrated.attempt, migrated.delivered_token_ids = 1, [7]
            again = await place(client, "ho1", migrated)
            assert again.accepted and (again.prefill_worker, again.decode_worker) == ("", "d1")
            assert isinstance(d1.received[-1], DecodeTask)
            assert [type(m) for m in p1.received] == [PrefillTask]
            # Another prompt (r1's is cached on d1 now: local anyway) avoids the pair too.
            other = await place(client, "ho1", submit("r2", list(range(300, 370))))
            assert other.accepted and other.prefill_worker == ""
            assert [type(m) for m in d1.received] == [Reserve, DecodeTask, DecodeTask]
            (service,) = services
            assert (fallbacks(service, "request"), fallbacks(service, "pair")) == (1, 1)

    asyncio.run(scenario())


def test_a_request_migrated_after_its_decode_worker_streamed_splits_again(nats_server):
    async def scenario() -> None:
        p1, d1 = FakeWorker("p1", "prefill"), FakeWorker("d1", "decode")
        async with mesh(nats_server.url, "ho2", [p1, d1]) as client:
            assert (await place(client, "ho2", submit("r1"))).prefill_worker == "p1"
            migrated = submit("r1~1")
            migrated.attempt, migrated.delivered_token_ids = 1, [7, 8, 9]  # decode had streamed
            assert (await place(client, "ho2", migrated)).prefill_worker == "p1"

    asyncio.run(scenario())


def test_a_replica_that_did_not_place_the_failed_split_judges_it_from_the_attempt(nats_server):
    """Scheduler replicas share the submits (a queue group), not their books: attempt 1 may
    reach a replica that never saw attempt 0. It names attempt 0's split (the gateway sets
    `last_prefill`, `last_decode`, `last_delivered`), so this replica, which placed nothing,
    still places it where it decodes."""

    async def scenario() -> None:
        p1, d1 = FakeWorker("p1", "prefill"), FakeWorker("d1", "decode")
        services: list[SchedulerService] = []
        async with mesh(nats_server.url, "ho3", [p1, d1], services) as client:
            migrated = submit("r1~1")
            migrated.attempt, migrated.delivered_token_ids = 1, [7]
            migrated.last_prefill, migrated.last_decode = "p1", "d1"  # placed elsewhere
            again = await place(client, "ho3", migrated)
            assert again.accepted and (again.prefill_worker, again.decode_worker) == ("", "d1")
            assert isinstance(d1.received[-1], DecodeTask) and not p1.received
            (service,) = services
            assert fallbacks(service, "request") == 1

    asyncio.run(scenario())
