"""Issue 60, case 1: a prefill worker SIGKILLed while a decode worker READs its KV by NIXL
(`make chaos`). The mesh's KV moves by UCX over TCP (`UCX_TLS=tcp,self`), where a READ
needs the side being read to progress.

- At a chosen point of one READ: the READ-hold test hook (shared/kvtransfer/read_hold.py,
  armed through the file `SPLITSERVE_TEST_HOLD_READ` names) holds the next READ of the mesh
  and the test SIGKILLs the prefill worker it is from as soon as the hold begins:
  `before` it is posted (it is then posted to a dead peer and fails), `in_flight` (posted,
  not progressed by the reader: the peer may have answered into the socket before the
  kill, so it fails or completes), `stopped_in_flight` (held before, the peer SIGSTOPped,
  the READ posted to it, then the kill: it fails, NIXL's peer failure), `landed` (every
  byte in, the handle not released, the prefill side not answered: it completes).
- By SIGSTOP alone: the prefill worker is stopped 0.3, 0.6 or 1.0 s into the load (every
  READ from it held open) and SIGKILLed 0.2 s later.

Each: every stream completes once, identical to the engine's; none hangs; every worker
ends idle with all its blocks free (no decode slot held past the transfer's deadline)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.kvtransfer.nixl_transport import nixl_available
from shared.kvtransfer.read_hold import VARIABLE
from tests.e2e.test_chaos import (
    STREAMS,
    assert_blocks_return,
    assert_same_texts,
    make_jobs,
    reference,
    report,
    run_load,
    worker_pid,
)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)

NIXL, WHY_NOT = nixl_available()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.chaos,
    pytest.mark.skipif(not NIXL, reason=f"NIXL unavailable: {WHY_NOT}"),
]
HOLD_S = 0.2  # between the SIGSTOP (READs held open) and the SIGKILL
HOLD_READ_S = 1.0  # the hook's hold: the kill comes within it, a WorkerLost after it
HELD = re.compile(r"test hold: READ of \d+ blocks from (\S+) held")
RELEASED = re.compile(r"test hold: READ of \d+ blocks from \S+ released (\w+): (.+)$", re.M)


@pytest.fixture(scope="module")
def tcp_mesh(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    home = tmp_path_factory.mktemp("chaos-hand-off")
    settings = {"UCX_TLS": "tcp,self", VARIABLE: str(home / "hold-read")}
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        flags = ["--prefill", "2", "--decode", "2", "--path-choice", "fixed"]
        flags += ["--kv-transport", "nixl"]
        yield from start_mesh(mesh_model_dir, home, flags)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def a_prefill_worker(mesh: Mesh) -> str:
    ids = sorted(w.heartbeat.worker_id for w in mesh.status().workers)
    return next(i for i in ids if i.startswith("prefill"))


def wait_whole(mesh: Mesh, victim: str) -> None:
    """Until the victim is gone from the mesh and its restart has joined (4 workers)."""
    deadline = time.monotonic() + 60
    while len(ids := {w.heartbeat.worker_id for w in mesh.status().workers}) < 4 or victim in ids:
        assert time.monotonic() < deadline, f"{victim} was not replaced: {ids}"
        time.sleep(0.5)


def kill_when_held(mesh: Mesh, case: str, log_start: int) -> tuple[Callable[[], None], list[str]]:
    """Arm the hook for the next READ, and a fault for `run_load` that SIGKILLs the prefill
    worker that READ is from as soon as its hold begins (in the log past `log_start`); for
    `stopped_in_flight`, SIGSTOPs it then, and SIGKILLs it once the READ has been posted to
    it (it cannot answer: the READ is in flight at the kill). The list gets the victim."""
    point = "before" if case == "stopped_in_flight" else case
    armed = Path(os.environ[VARIABLE])
    staged = armed.with_suffix(".new")
    staged.write_text(f"{point}:{HOLD_READ_S}")
    staged.rename(armed)  # whole, never half-written, when a worker reads it
    victims: list[str] = []

    def logged(pattern: re.Pattern[str]) -> re.Match[str]:
        deadline = time.monotonic() + 30
        while not (found := pattern.search(mesh.log_path.read_text()[log_start:])):
            assert time.monotonic() < deadline, f"no {pattern.pattern!r} in the log ({case})"
            time.sleep(0.01)
        return found

    def fault() -> None:
        victim = logged(HELD).group(1)
        victims.append(victim)
        pid = worker_pid(mesh, victim)
        if case == "stopped_in_flight":
            os.kill(pid, signal.SIGSTOP)
            logged(RELEASED)
            time.sleep(0.2)  # the READ is posted right after the hold ends
        os.kill(pid, signal.SIGKILL)

    return fault, victims


# The held READ's end: failed (posted to a dead or stopped-then-dead peer), done (its bytes
# had landed), or either (posted to a live peer that answered into the socket before the
# kill, or not).
READ_ENDS = {"before": "failed", "stopped_in_flight": "failed", "landed": "done"}


@pytest.mark.parametrize(
    ("case", "tag"), [("before", 61), ("in_flight", 62), ("stopped_in_flight", 63), ("landed", 64)]
)
def test_prefill_killed_at_a_point_of_a_read(tcp_mesh, mesh_model_dir, case, tag):  # noqa: F811
    jobs = make_jobs(tag)
    expected = reference(mesh_model_dir, jobs)
    log_start = tcp_mesh.log_path.stat().st_size
    fault, victims = kill_when_held(tcp_mesh, case, log_start)
    outcomes = run_load(tcp_mesh, jobs, fault, after_chunks=0)
    log = tcp_mesh.log_path.read_text()[log_start:]
    state = (RELEASED.search(log) or ["", "", "?"])[2].strip()
    read_failed = f"READ from {victims[0]} failed" in log
    name = f"prefill SIGKILL, a NIXL READ held {case} (released: {state}; failed: {read_failed})"
    assert report(name, outcomes)[0] == STREAMS
    assert_same_texts(jobs, outcomes, expected)
    if READ_ENDS.get(case) == "failed":
        assert read_failed, log[-4000:]
    if READ_ENDS.get(case) == "done":
        assert state == "SUCCESS", log[-4000:]
    wait_whole(tcp_mesh, victims[0])
    assert_blocks_return(tcp_mesh, 4)


@pytest.mark.parametrize("stop_at_s", [0.3, 0.6, 1.0])
def test_prefill_killed_while_its_kv_is_read(tcp_mesh, mesh_model_dir, stop_at_s):  # noqa: F811
    jobs = make_jobs(80 + int(stop_at_s * 10))
    expected = reference(mesh_model_dir, jobs)
    victim = a_prefill_worker(tcp_mesh)
    pid = worker_pid(tcp_mesh, victim)

    def fault() -> None:
        time.sleep(stop_at_s)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(HOLD_S)
        os.kill(pid, signal.SIGKILL)

    outcomes = run_load(tcp_mesh, jobs, fault, after_chunks=0)
    assert (
        report(f"prefill SIGSTOP+SIGKILL at {stop_at_s} s (NIXL over TCP)", outcomes)[0] == STREAMS
    )
    assert_same_texts(jobs, outcomes, expected)
    wait_whole(tcp_mesh, victim)
    assert_blocks_return(tcp_mesh, 4)
