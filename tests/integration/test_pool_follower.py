"""`splitserve up` following a PoolTarget (services/pool_follower.py) with stand-in workers
(small Python scripts started by the real supervisor) and hand-made scheduler statuses: it
starts the missing workers from the plan's template, counts a started worker until it
registers, drains the worker holding the fewest requests, retires it (never restarts it),
does not count a drained id again, and gives a pinned worker free cores or refuses once."""

from __future__ import annotations

import logging
import sys
import time
from itertools import count
from pathlib import Path

import pytest

from services import pool_follower
from services.launch_plan import PinnedPool, WorkerTemplate
from services.pool_follower import PoolFollower
from services.pool_link import PoolLink
from services.supervisor import Supervisor
from shared.nats_options import NatsAuth
from shared.pool_messages import PoolTarget
from shared.protocol import Heartbeat, MeshStatus, WorkerStatus
from shared.subjects import Subjects

# A stand-in worker: records "start ID" (its --worker-id); on SIGTERM "drained ID", exit 0.
STAND_IN = """
import signal, sys, time
log, argv = sys.argv[1], sys.argv[2:]
worker_id = argv[argv.index("--worker-id") + 1]
def bye(*_):
    open(log, "a").write(f"drained {worker_id}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
open(log, "a").write(f"start {worker_id} {' '.join(argv)}\\n")
while True:
    time.sleep(0.02)
"""


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def status(*workers: tuple[str, str, int]) -> MeshStatus:
    """Workers as (id, role, requests held)."""
    beats = [Heartbeat(w, role, "m", n, 0, 10, 10, 16, num_requests=n) for w, role, n in workers]
    return MeshStatus([WorkerStatus(b, 0.0) for b in beats], 0, 0, 0)


def target(seq_no: int, prefill: int = 0, decode: int = 0, both: int = 0) -> PoolTarget:
    return PoolTarget("planner-1", seq_no, "", prefill, decode, both, "queue too long")


@pytest.fixture
def mesh(tmp_path):
    """(follower, supervisor, log file, template-maker) and the stopping of it all."""
    log = tmp_path / "workers.log"
    made: list[tuple[Supervisor, PoolLink]] = []

    def make(pools: tuple[PinnedPool, ...] = (), first_cpus: tuple[int, ...] = ()):
        service = (sys.executable, "-c", STAND_IN, str(log))
        template = WorkerTemplate(Path("/m"), ("--nats", "u"), ("--x", "1"), "", pools, service)
        ports = count(9100)
        supervisor = Supervisor([template.spec("decode", "decode-0", first_cpus, 9099)], 0.05, 5, 2)
        link = PoolLink("nats://127.0.0.1:1", NatsAuth(), Subjects())  # never started
        made.append((supervisor, link))
        supervisor.start_all()
        return PoolFollower(link, template, supervisor, ports, max_workers=4), supervisor

    yield make, log
    for supervisor, link in made:
        link.close()
        supervisor.stop_all()


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_adds_then_drains_the_least_busy_worker_and_retires_it(mesh, caplog):
    caplog.set_level(logging.INFO, logger="services")
    make, log = mesh
    follower, supervisor = make()
    follower.follow(target(1, decode=2, both=1), status(("decode-0", "decode", 0)))
    assert [c.spec.name for c in supervisor.children] == [
        "worker decode-0",
        "worker decode-1",
        "worker both-0",
    ]
    wait_for(lambda: len(lines(log)) == 3)
    started = {line.split()[1]: line for line in lines(log)}
    assert "--role both" in started["both-0"] and "--metrics-port 9100" in started["decode-1"]
    assert "--x 1" in started["both-0"]  # the template's forwarded flags
    assert "adding worker both-0 (both) for pool target planner-1 #1" in caplog.text
    assert "queue too long" in caplog.text
    # Not registered yet (loading): counted as pending, so nothing more is started.
    follower.follow(target(1, decode=2, both=1), status(("decode-0", "decode", 0)))
    assert len(supervisor.children) == 3

    registered = status(("decode-0", "decode", 3), ("decode-1", "decode", 1), ("both-0", "both", 0))
    follower.follow(target(2, decode=1, both=1), registered)
    assert "draining worker decode-1 (decode) for pool target planner-1 #2" in caplog.text
    wait_for(lambda: "drained decode-1" in lines(log))
    wait_for(lambda: (supervisor.poll(), len(supervisor.children))[1] == 2)
    assert "worker decode-1 drained and exited with 0: retired" in caplog.text
    for _ in range(5):  # never restarted
        supervisor.poll()
        time.sleep(0.06)
    assert [line.split()[1] for line in lines(log) if line.startswith("start")].count(
        "decode-1"
    ) == 1
    # The scheduler still lists decode-1 as it last beat: not counted, nothing drained more.
    follower.follow(target(2, decode=1, both=1), registered)
    drains = [r for r in caplog.records if r.name == "services.pool_follower" and "drain" in r.msg]
    assert len(drains) == 1
    assert [c.spec.name for c in supervisor.children] == ["worker decode-0", "worker both-0"]


def test_a_pinned_worker_takes_a_free_core_or_is_refused_once(mesh, caplog, monkeypatch):
    monkeypatch.setattr(pool_follower, "usable_cores", lambda: {0, 1})
    make, log = mesh
    follower, supervisor = make(pools=(PinnedPool("decode", (0,)),), first_cpus=(0,))
    for _ in range(2):
        follower.follow(target(1, decode=3), status(("decode-0", "decode", 0)))
    assert [c.spec.cpus for c in supervisor.children] == [(0,), (1,)]
    wait_for(lambda: len(lines(log)) == 2)
    assert any(line.startswith("start decode-1") and "--cpus 1" in line for line in lines(log))
    refusal = "decode: no 1 free core(s) for one more pinned worker"
    assert caplog.text.count(refusal) == 1
    assert supervisor.held_cores() == {0, 1}
