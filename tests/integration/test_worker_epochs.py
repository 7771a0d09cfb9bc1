"""Epoch fencing with real workers (tests/integration/test_worker.py's mesh): a KV chunk of
a finished transfer, replayed to a decode worker restarted under the same id, is refused
naming the two process epochs; a transfer to the new process goes through."""

from __future__ import annotations

from nats.aio.msg import Msg

from services.worker.runtime import Worker
from shared.protocol import KVChunk, Outcome, TaskAck, decode, decode_one_of
from tests.integration.test_worker import GREEDY, Mesh, nats_only, run_mesh, until


def test_an_old_kv_chunk_replayed_to_a_restarted_decode_worker_is_refused(
    nats_server, tiny_model_dir
):
    async def scenario(mesh: Mesh) -> None:
        recorded: list[bytes] = []

        async def record(msg: Msg) -> None:
            if isinstance(decode_one_of(msg.data, KVChunk, object), KVChunk):
                recorded.append(msg.data)

        subject = mesh.subjects.kv("decode")
        await mesh.bus.nc.subscribe(subject, cb=record)
        res = await mesh.split(mesh.request("first", GREEDY))
        await mesh.tokens("first")
        assert recorded and res.epoch == mesh.workers[1].epoch > 0
        old = mesh.workers[1]
        await old.shutdown()
        new = mesh.workers[1] = Worker(old.config, transport_factory=nats_only)
        await new.start()
        assert new.epoch != old.epoch
        # its subscriptions are in place once the server has passed on a heartbeat of it
        await until(lambda: mesh.beats["decode"].epoch == new.epoch)
        reply = await mesh.bus.nc.request(subject, recorded[0], timeout=5)
        ack = decode(reply.data, TaskAck)
        assert ack.outcome == Outcome.INVALID
        assert f"process epoch {old.epoch}" in ack.error
        assert f"this process is epoch {new.epoch}" in ack.error
        res = await mesh.split(mesh.request("second", GREEDY))
        assert res.epoch == new.epoch
        await until(lambda: bool(mesh.chunks.get("second")))
        await mesh.tokens("second")

    run_mesh(nats_server.url, tiny_model_dir, scenario)
