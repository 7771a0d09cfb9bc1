"""Sleep and wake-up of workers under load (services/worker/sleep.py): a worker told to
sleep while it streams finishes its streams first (seeded streams exact), takes no work
while asleep (and says so in its heartbeats), gives back its KV pool (level 1) or its
weights too (level 2), and after waking up streams exactly what it did before."""

from __future__ import annotations

from shared.engine.sampling_params import SamplingParams
from shared.protocol import Outcome, Reservation, Reserve
from shared.sleep_level import SleepLevel
from shared.sleep_messages import SleepCommand, SleepReply
from tests.integration.test_worker import PROMPT, Mesh, reference, run_mesh, until

SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)


async def command(mesh: Mesh, worker: str, level: SleepLevel) -> SleepReply:
    subject = mesh.subjects.sleep(worker)
    return await mesh.bus.request(subject, SleepCommand(level, 20.0), SleepReply, timeout=60)


def test_sleep_under_load_drains_exactly_refuses_work_and_wakes_up(nats_server, tiny_model_dir):
    expected = reference(tiny_model_dir, PROMPT, SEEDED)

    async def scenario(mesh: Mesh) -> None:
        for level in (SleepLevel.KV_FREED, SleepLevel.WEIGHTS_FREED):
            streaming = [f"r{level}-{i}" for i in range(3)]
            for request_id in streaming:
                await mesh.split(mesh.request(request_id, SEEDED))
            # both workers fall asleep while those stream: they finish first
            replies = [await command(mesh, w, level) for w in ("decode", "prefill")]
            assert all(r.ok and r.level == level for r in replies), replies
            for request_id in streaming:
                assert await mesh.tokens(request_id) == expected
            await until(lambda at=level: all(b.sleep_level == at for b in mesh.beats.values()))
            refused = await mesh.bus.request(
                mesh.subjects.reserve("decode"), Reserve(mesh.request("late", SEEDED)),
                Reservation, 5,
            )  # fmt: skip
            assert (refused.outcome, refused.error) == (Outcome.UNAVAILABLE, "asleep")
            assert all(w.engine.stats().free_blocks == w.engine.stats().total_blocks
                       for w in mesh.workers)  # fmt: skip
            replies = [await command(mesh, w, SleepLevel.AWAKE) for w in ("decode", "prefill")]
            assert all(r.ok and r.level == SleepLevel.AWAKE for r in replies), replies
            await mesh.split(mesh.request(f"after-{level}", SEEDED))
            assert await mesh.tokens(f"after-{level}") == expected

    run_mesh(nats_server.url, tiny_model_dir, scenario)
