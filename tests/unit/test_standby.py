"""The standby worker (services/standby.py): a process with a worker's imports done that
becomes the next worker `up` starts while serving: it runs the handed-off `-m MODULE ARGS`
with the hand-off's environment and exit status, its command line in /proc the handed-off
one, its start-up clock from the hand-off; no standby, a dead one, a command that is not
`python -m` or does not fit the standby's room starts a process as before; a standby nobody
needs exits when closed, one handed a bad command refuses it. Under the supervisor, the
first standby starts once the mesh serves; workers added or restarted come from it, the
plan's first ones and other services do not."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from services.proc_argv import ROOM_BYTES
from services.standby import HANDED_OFF_AT_ENV, REFUSED, StandbyWorker
from services.supervisor import ChildSpec, Supervisor
from services.worker.startup import process_age

PROBE = (sys.executable, "-m", "tests.unit.standby_probe")


def environment(**extra: str) -> dict[str, str]:
    return dict(os.environ) | {"PYTHONPATH": os.getcwd()} | extra


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def wait_ready(standby: StandbyWorker) -> None:
    deadline = time.monotonic() + 120
    while not standby.ready():
        assert time.monotonic() < deadline, "the standby never said it was ready"
        time.sleep(0.05)


def test_a_standby_becomes_the_handed_off_command_with_its_environment(tmp_path: Path):
    standby = StandbyWorker(environment())
    standby.spawn()
    first = standby.process
    standby.spawn()  # one waits already: no second
    assert standby.process is first
    wait_ready(standby)
    out = tmp_path / "probe.json"
    env = environment(STANDBY_PROBE="handed", STANDBY_PROBE_EXIT="3")
    argv = (*PROBE, str(out), "--role", "decode", "--worker-id", "w 1")
    process = standby.take(argv, env)
    assert process is first and standby.process is None
    assert process.wait(120) == 3  # the command's own exit status
    assert read(out) == {
        "args": ["--role", "decode", "--worker-id", "w 1"],
        "probe_env": "handed",
        "handed_off": True,
        "warm": True,  # the worker's imports were done before the hand-off
        "name": "__main__",
        "cmdline": list(argv),  # what ps and pgrep -f see: the worker, argument by argument
    }


def test_without_a_ready_standby_or_a_fitting_command_nothing_is_taken(tmp_path: Path):
    standby = StandbyWorker(environment())
    assert standby.take((*PROBE, str(tmp_path / "x")), environment()) is None  # none spawned
    standby.spawn()
    waiting = standby.process
    # still importing: a fresh process starts the worker, the standby keeps waiting
    assert standby.take((*PROBE, str(tmp_path / "x")), environment()) is None
    wait_ready(standby)
    assert standby.take(("/bin/true",), environment()) is None  # not `python -m`: not for it
    too_long = (*PROBE, str(tmp_path / "z"), "x" * ROOM_BYTES)
    assert standby.take(too_long, environment()) is None  # no room for its command line
    assert standby.process is waiting and waiting.poll() is None  # still there for the next
    waiting.kill()
    waiting.wait()
    assert standby.take((*PROBE, str(tmp_path / "y")), environment()) is None  # died
    standby.spawn()  # noticed: no more
    assert standby.process is None and standby.died


def test_a_standby_nobody_needs_is_ended_when_closed():
    standby = StandbyWorker(environment())
    standby.spawn()
    waiting = standby.process
    standby.close()
    assert waiting.poll() is not None and standby.process is None


def test_a_standby_refuses_a_hand_off_that_is_not_a_module():
    standby = StandbyWorker(environment())
    standby.spawn()
    process = standby.process
    handoff = json.dumps({"argv": ["-c", "print(1)"], "env": environment()}) + "\n"
    try:
        process.communicate(handoff.encode(), timeout=120)
    finally:
        standby.close()
    assert process.returncode == REFUSED


def test_a_standby_that_dies_waiting_is_not_started_again():
    standby = StandbyWorker(environment())
    standby.spawn()
    standby.process.kill()
    standby.process.wait()
    standby.spawn()  # noticed: no start loop of a standby that cannot stay up
    assert standby.process is None and standby.died
    standby.spawn()
    assert standby.process is None


def test_the_start_up_clock_of_a_handed_off_worker_counts_from_the_hand_off(monkeypatch):
    monkeypatch.setenv(HANDED_OFF_AT_ENV, repr(time.time() - 2.5))
    assert 2.4 < process_age() < 10.0
    monkeypatch.delenv(HANDED_OFF_AT_ENV)
    assert process_age() > 0.0


def test_workers_added_while_serving_come_from_the_standby(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    first = ChildSpec("worker w0", "worker", (*PROBE, str(tmp_path / "w0.json")))
    supervisor = Supervisor([first], 0.1, 5, grace=5.0, standby=True)
    try:
        supervisor.start_all()
        supervisor.poll()  # the plan's children do not serve yet: no standby
        assert supervisor.standby is not None and supervisor.standby.process is None
        supervisor.serving()
        supervisor.poll()  # due: the standby starts
        waiting = supervisor.standby.process
        assert waiting is not None
        wait_ready(supervisor.standby)
        added = supervisor.add(
            ChildSpec("worker w1", "worker", (*PROBE, str(tmp_path / "w1.json")))
        )
        assert added.process is waiting
        other = supervisor.add(ChildSpec("gateway", "gateway", (*PROBE, str(tmp_path / "g.json"))))
        assert other.process is not waiting
        for child in supervisor.children:
            child.process.wait(120)
        assert read(tmp_path / "w1.json")["handed_off"] is True
        assert read(tmp_path / "w0.json")["handed_off"] is False  # the plan's own: a fresh start
        assert read(tmp_path / "g.json")["handed_off"] is False
        supervisor.poll()  # the next standby
        assert supervisor.standby.process not in (None, waiting)
    finally:
        supervisor.stop_all()
    assert supervisor.standby.process is None


def test_no_standby_when_turned_off():
    supervisor = Supervisor([], 0.1, 5, grace=5.0, standby=False)
    supervisor.start_all()
    supervisor.serving()
    supervisor.poll()
    assert supervisor.standby is None
