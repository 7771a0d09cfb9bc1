"""A child that exits saying it cannot run its configuration (services/cannot_run.py) is
not restarted, and the supervisor holds its message; any other exit is restarted."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from services.cannot_run import CANNOT_RUN
from services.supervisor import ChildSpec, Supervisor

ROOT = Path(__file__).resolve().parents[2]
REFUSES = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from services.cannot_run import exit_cannot_run
exit_cannot_run("worker", "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])")
"""
CRASHES = "import sys; sys.exit(3)"


def supervised(script: str) -> Supervisor:
    spec = ChildSpec("worker w", "worker", (sys.executable, "-c", script))
    return Supervisor([spec], restart_backoff=0.01, max_restarts_per_minute=5, grace=1)


def run_until_exited(supervisor: Supervisor, polls: int = 1) -> None:
    child = supervisor.children[0]
    for _ in range(polls):
        child.process.wait(20)
        supervisor.poll()  # notices the exit (and schedules a restart, if any)
        time.sleep(0.05)  # past the backoff
        supervisor.poll()  # starts it again when due


def test_a_child_that_cannot_run_is_not_restarted_and_leaves_its_message():
    supervisor = supervised(REFUSES)
    supervisor.start_all()
    try:
        run_until_exited(supervisor)
        child = supervisor.children[0]
        assert child.process.returncode == CANNOT_RUN
        assert child.incarnation == 1 and child.gave_up
        assert supervisor.cannot_run() == [
            ("worker w", "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])")
        ]
    finally:
        supervisor.stop_all()


def test_a_child_that_crashes_is_restarted_and_names_no_configuration():
    supervisor = supervised(CRASHES)
    supervisor.start_all()
    try:
        run_until_exited(supervisor)
        assert supervisor.children[0].incarnation == 2
        assert supervisor.cannot_run() == []
    finally:
        supervisor.stop_all()
