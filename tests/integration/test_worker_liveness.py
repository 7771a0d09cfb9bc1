"""A real worker's side of liveness (tests/integration/test_worker.py's mesh): it answers
the scheduler's probe with its process epoch, the one its heartbeats carry; and a
`WorkerLost` naming itself (it was frozen past the probe and its requests went elsewhere)
drops what it names without a word to the gateway, freeing their blocks."""

from __future__ import annotations

from shared.engine.sampling_params import SamplingParams
from shared.liveness_messages import Probe, ProbeAck
from shared.protocol import Reservation, Reserve, WorkerLost
from tests.integration.test_worker import GREEDY, Mesh, run_mesh, until

LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


def test_probe_answered_with_the_epoch_of_the_heartbeats(nats_server, tiny_model_dir):
    async def scenario(mesh: Mesh) -> None:
        await until(lambda: {"prefill", "decode"} <= set(mesh.beats))
        epochs = {}
        for worker_id in ("prefill", "decode"):
            probe = Probe(worker_id, mesh.beats[worker_id].epoch)
            ack = await mesh.bus.request(mesh.subjects.probe(worker_id), probe, ProbeAck, 2)
            assert ack.ok and ack.worker_id == worker_id
            epochs[worker_id] = ack.epoch
            assert ack.epoch == mesh.beats[worker_id].epoch > 0
        assert epochs["prefill"] != epochs["decode"]

    run_mesh(nats_server.url, tiny_model_dir, scenario)


def test_worker_lost_naming_itself_drops_what_it_names(nats_server, tiny_model_dir):
    async def scenario(mesh: Mesh) -> None:
        await mesh.split(mesh.request("long", LONG))
        await until(lambda: len(mesh.chunks.get("long", [])) >= 3)
        held = mesh.request("held", GREEDY)  # a reservation whose KV never comes
        reserve = Reserve(held)
        assert (await mesh.bus.request(mesh.subjects.reserve("decode"), reserve, Reservation, 5)).ok
        lost = WorkerLost("decode", ["long", "held", "unknown"])
        mesh.beats.clear()
        await mesh.bus.publish(mesh.subjects.events, lost)

        def all_free() -> bool:
            beat = mesh.beats.get("decode")
            return beat is not None and beat.free_blocks == beat.total_blocks

        await until(all_free, timeout=5)
        assert not any(c.error or c.finish_reason for c in mesh.chunks["long"])

    run_mesh(nats_server.url, tiny_model_dir, scenario)
