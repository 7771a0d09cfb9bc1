"""The scheduler's prefix-read hint (`--kv-peer-reads`) on a real SchedulerService: the task
sent to the worker that computes a prompt names the worker whose pool holds more of it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.prefix_messages import PeerPrefix
from shared.protocol import DecodeTask, Heartbeat, Outcome
from tests.integration.scheduler_harness import HASHES, FakeWorker, mesh, place, submit


@dataclass
class OneSidedWorker(FakeWorker):
    """A fake worker that moves KV by nixl (a READ from a peer is possible)."""

    async def beat(self) -> None:
        self.room = self.room_per_beat
        heartbeat = Heartbeat(
            self.worker_id, self.role, "m", 0, self.busy_answers, self.free_blocks, 200, 16,
            kv_transports=["nixl", "nats"], epoch=self.epoch,
        )  # fmt: skip
        await self.bus.publish(self.subjects.heartbeat, heartbeat)


def placed_task(nats_url: str, namespace: str, peer_reads: bool) -> DecodeTask:
    """The holder `h` (the best score) is busy: the prompt goes to `a`, which holds none."""
    holder = OneSidedWorker("h", "both", cached=HASHES, task=Outcome.BUSY, epoch=3)
    other = OneSidedWorker("a", "both")

    async def main() -> DecodeTask:
        async with mesh(nats_url, namespace, [holder, other], kv_peer_reads=peer_reads) as client:
            ack = await place(client, namespace, submit("r1"))
            assert ack.outcome == Outcome.OK and ack.decode_worker == "a", ack
            (task,) = [m for m in other.received if isinstance(m, DecodeTask)]
            return task

    return asyncio.run(main())


def test_the_task_names_the_worker_holding_more_of_the_prefix(nats_server):
    task = placed_task(nats_server.url, "peer1", peer_reads=True)
    assert task.prefix_peer == PeerPrefix("h", 3, 0, len(HASHES))


def test_without_kv_peer_reads_no_worker_is_named(nats_server):
    assert placed_task(nats_server.url, "peer2", peer_reads=False).prefix_peer is None
