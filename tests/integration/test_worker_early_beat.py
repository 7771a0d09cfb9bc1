"""A request that ends brings its worker's next heartbeat forward.

The scheduler counts the blocks it placed on a worker since that worker's last heartbeat as
taken. With a beat only every interval, a request placed just after another one ended waited
for room the worker already had, up to a whole interval (the tier benchmark's multi-turn
runs: every other turn 600 ms). Real workers over a real nats-server, as in test_worker.py.
"""

from __future__ import annotations

import time

from shared.protocol import Heartbeat
from tests.integration.test_worker import GREEDY, Mesh, run_mesh, until

INTERVAL_S = 10.0  # the regular beat: far longer than the test waits


def test_a_request_that_ends_brings_the_next_heartbeat_forward(nats_server, tiny_model_dir):
    async def scenario(mesh: Mesh) -> None:
        beats: list[tuple[float, Heartbeat]] = []  # decode's, with when they came

        async def on_beat(beat: Heartbeat, headers: dict[str, str]) -> None:
            if beat.worker_id == "decode":
                beats.append((time.monotonic(), beat))

        await mesh.bus.subscribe(mesh.subjects.heartbeat, Heartbeat, on_beat)
        await until(lambda: bool(beats))  # a regular beat: the next is INTERVAL_S later
        first = beats[-1][0]
        await mesh.split(mesh.request("short", GREEDY))
        await mesh.tokens("short")

        def freed() -> list[float]:  # only an ended request beats early, and frees blocks
            return [t for t, b in beats if t > first and b.free_blocks == b.total_blocks]

        await until(lambda: bool(freed()), timeout=INTERVAL_S * 1.5)
        assert freed()[0] - first < INTERVAL_S * 0.8, "the regular beat, not one brought forward"

    run_mesh(nats_server.url, tiny_model_dir, scenario, heartbeat_interval=INTERVAL_S)
