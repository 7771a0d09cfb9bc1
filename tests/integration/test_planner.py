"""The planner on a real nats-server that admits only the mesh's roles: connected as its
NATS user `planner`, it hears the workers' heartbeats, asks them to change roles (SetRole,
answered through its own reply inbox), publishes a PoolTarget the `launcher` user receives,
and its report reaches the scheduler's status. The workers are stand-ins (NATS user `both`)
that beat every 0.1 s with slow streams. And the source of its TPOTs: a real decode worker
(the tiny model) reports each stream it ends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest

from services.planner.config import PlannerConfig, PlannerServiceConfig
from services.planner.service import PlannerService
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared.bus import Bus, Headers
from shared.config import CommonConfig
from shared.nats_auth import MeshCredentials, start_mesh_nats
from shared.pool_messages import PoolTarget
from shared.protocol import FirstToken, Heartbeat, Outcome, SetRole, StatusQuery, TaskAck
from shared.subjects import Subjects
from tests.integration.test_worker import GREEDY, Mesh
from tests.integration.test_worker import run_mesh as run_worker_mesh
from tests.integration.test_worker import until as wait_until

NAMESPACE = "ss"
POLICY = PlannerConfig(hold=1, cooldown=60.0, min_samples=1)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    server, credentials = start_mesh_nats(tmp_path_factory.mktemp("nats"), None, Subjects())
    yield server.url, credentials
    server.stop()


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def fake_workers(bus: Bus, roles: dict[str, str], asked: dict[str, str]) -> asyncio.Task:
    """Workers that beat with slow streams (TPOT 90 ms) and accept every SetRole."""
    subjects = Subjects(NAMESPACE)
    for worker_id in roles:

        async def set_role(message: SetRole, headers: Headers, worker_id=worker_id) -> TaskAck:
            asked[worker_id] = message.role
            return TaskAck("", Outcome.OK)

        await bus.serve(subjects.role(worker_id), SetRole, set_role, _refuse)

    async def beat() -> None:
        while True:
            for worker_id, role in roles.items():
                firsts = [FirstToken(f"{worker_id}-r", 0.2)]
                message = Heartbeat(
                    worker_id, role, "m", 2, 0, 50, 100, 16, busy=0.6, first_tokens=firsts,
                    stream_tpots=[0.09],
                )  # fmt: skip
                await bus.publish(subjects.heartbeat, message)
            await asyncio.sleep(0.1)

    return asyncio.create_task(beat())


def connect(url: str, credentials: MeshCredentials, role: str) -> Awaitable[Bus]:
    return Bus.connect(url, f"test-{role}", auth=credentials.auth(role))


def config(url: str, credentials: MeshCredentials, policy: PlannerConfig) -> PlannerServiceConfig:
    common = CommonConfig(url, NAMESPACE, "INFO", nats_auth=credentials.auth("planner"))
    return PlannerServiceConfig(common=common, policy=policy, planner_interval=0.2)


def test_roles_mode_changes_roles_and_the_scheduler_shows_its_report(secured):
    url, credentials = secured

    async def main() -> None:
        asked: dict[str, str] = {}
        workers = await connect(url, credentials, "both")
        beating = await fake_workers(workers, {"b0": "both", "b1": "both"}, asked)
        scheduler_bus = await connect(url, credentials, "scheduler")
        scheduler = SchedulerService(SchedulerConfig(), scheduler_bus)
        await scheduler.start()
        planner_config = config(url, credentials, replace(POLICY, mode="roles"))
        planner_bus = await Bus.connect(url, "planner", auth=planner_config.common.nats_auth)
        planner = PlannerService(planner_config, planner_bus)
        await planner.start()
        try:

            async def asked_both() -> bool:
                return len(asked) == 2

            async def reported() -> bool:
                status = await scheduler.on_status(StatusQuery(), {})
                return status.planner is not None and len(status.planner.decisions) == 2

            await until(asked_both)
            assert sorted(asked.values()) == ["decode", "prefill"]
            await until(reported)
            status = await scheduler.on_status(StatusQuery(), {})
            assert status.planner is not None
            assert {d.outcome for d in status.planner.decisions} == {"ok"}
            assert status.planner.mode == "roles"
        finally:
            beating.cancel()
            await planner.stop()
            await scheduler.stop()
            for bus in (planner_bus, scheduler_bus, workers):
                await bus.close()

    asyncio.run(main())


def test_replicas_mode_publishes_a_target_the_launcher_user_receives(secured):
    url, credentials = secured

    async def main() -> None:
        workers = await connect(url, credentials, "both")
        beating = await fake_workers(workers, {"p0": "prefill", "d0": "decode"}, {})
        launcher = await connect(url, credentials, "launcher")
        targets: list[PoolTarget] = []

        async def on_target(target: PoolTarget, headers: Headers) -> None:
            targets.append(target)

        await launcher.subscribe(Subjects(NAMESPACE).pool_target, PoolTarget, on_target)
        planner_config = config(url, credentials, POLICY)
        planner_bus = await Bus.connect(url, "planner", auth=planner_config.common.nats_auth)
        planner = PlannerService(planner_config, planner_bus)
        await planner.start()
        try:

            async def published() -> bool:
                return bool(targets)

            await until(published)
            (target,) = targets
            assert (target.prefill, target.decode, target.both) == (1, 2, 0)
            assert (target.publisher, target.reason) == ("planner", "tpot_over_slo")
        finally:
            beating.cancel()
            await planner.stop()
            for bus in (planner_bus, launcher, workers):
                await bus.close()

    asyncio.run(main())


def _refuse(reason: str) -> TaskAck:
    return TaskAck("", Outcome.INVALID, reason)


def test_a_real_decode_worker_reports_the_tpot_of_each_stream_it_ends(nats_server, tiny_model_dir):
    """The planner's TPOT source: a split request's decode worker puts its stream's time per
    output token in a heartbeat once the stream ends; the prefill worker reports none."""

    async def scenario(mesh: Mesh) -> None:
        tpots: dict[str, list[float]] = {}

        async def on_beat(beat: Heartbeat, headers: Headers) -> None:
            tpots.setdefault(beat.worker_id, []).extend(beat.stream_tpots)

        await mesh.bus.subscribe(mesh.subjects.heartbeat, Heartbeat, on_beat)
        await mesh.split(mesh.request("r1", GREEDY))
        await mesh.tokens("r1")
        await wait_until(lambda: bool(tpots.get("decode")))
        (tpot,) = tpots["decode"]
        assert 0 < tpot < 5.0
        assert tpots.get("prefill", []) == []

    run_worker_mesh(nats_server.url, tiny_model_dir, scenario)
