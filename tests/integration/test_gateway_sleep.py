"""The gateway's sleep routes (services/gateway/sleep_routes.py): a command goes to every
worker of the named model (or the one named worker), each reply is listed, a worker that
could not carry it out makes the answer 409, and bad parameters are refused by name."""

from __future__ import annotations

import asyncio

import aiohttp

from shared.bus import Bus
from shared.protocol import Outcome
from shared.sleep_level import SleepLevel
from shared.sleep_messages import SleepCommand, SleepReply
from shared.subjects import Subjects
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.integration.test_web_gateway import MODEL, NAMESPACE, gateway


def test_sleep_and_wake_up_reach_the_workers_of_a_model_or_one_worker(
    nats_server,
    real_model_dir,  # noqa: F811
):
    commands: list[tuple[str, SleepCommand]] = []

    async def scenario() -> None:
        bus = await Bus.connect(nats_server.url, "fake-workers")
        subjects = Subjects(NAMESPACE)
        for worker_id in ("p0", "d0", "d1"):

            async def answer(command: SleepCommand, headers: dict, wid=worker_id) -> SleepReply:
                commands.append((wid, command))
                if wid == "d1" and command.level == SleepLevel.WEIGHTS_FREED:
                    return SleepReply(wid, SleepLevel.AWAKE, Outcome.UNAVAILABLE, "no sleep mode")
                return SleepReply(wid, command.level)

            await bus.serve(subjects.sleep(worker_id), SleepCommand, answer, lambda _: None)
        async with (
            gateway(nats_server, real_model_dir) as (url, _),
            aiohttp.ClientSession() as http,
        ):

            async def post(path: str) -> tuple[int, dict]:
                async with http.post(url + path) as reply:
                    return reply.status, await reply.json()

            status, body = await post(f"/sleep?level=1&model={MODEL}&drain_timeout=5")
            assert status == 200
            assert sorted(w["id"] for w in body["workers"]) == ["d0", "d1", "p0"]
            assert all(w["level"] == 1 and not w["error"] for w in body["workers"])
            assert {c.drain_timeout for _, c in commands} == {5.0}
            commands.clear()
            status, body = await post("/wake_up?worker=d0")
            assert (status, body["workers"]) == (200, [{"id": "d0", "level": 0, "error": ""}])
            assert [(w, c.level) for w, c in commands] == [("d0", SleepLevel.AWAKE)]
            status, body = await post(f"/sleep?level=2&model={MODEL}")
            assert status == 409
            assert {w["id"]: w["error"] for w in body["workers"]}["d1"] == "no sleep mode"
            assert (await post("/sleep?level=3"))[0] == 400
            assert (await post("/sleep?worker=nobody"))[0] == 404
            assert (await post(f"/sleep?model={MODEL}&worker=d0"))[0] == 400
            async with http.get(url + "/is_sleeping?worker=d0") as reply:
                assert (await reply.json())["workers"] == {"d0": 0}  # as its heartbeat says
        await bus.close()

    asyncio.run(scenario())
