"""Issue 60, case 1: a prefill worker SIGKILLed while decode workers READ its KV by NIXL
(`make chaos`). The mesh's KV moves by UCX over TCP (`UCX_TLS=tcp,self`), where a READ
needs the side being read to progress: a SIGSTOP of the prefill worker holds every READ
from it open, and the SIGKILL that follows ends them (NIXL's peer failure). At several
points of the hand-off (the stop comes 0.3, 0.6 or 1.0 s into the load, the kill 0.2 s
later): every stream completes, identical to the engine's; none hangs; every worker gets
its blocks back."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

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

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]
HOLD_S = 0.2  # between the SIGSTOP (READs held open) and the SIGKILL


@pytest.fixture(scope="module")
def tcp_mesh(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    before = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp,self"
    try:
        home = tmp_path_factory.mktemp("chaos-hand-off")
        flags = ["--prefill", "2", "--decode", "2", "--path-choice", "fixed"]
        flags += ["--kv-transport", "nixl"]
        yield from start_mesh(mesh_model_dir, home, flags)
    finally:
        if before is None:
            os.environ.pop("UCX_TLS")
        else:
            os.environ["UCX_TLS"] = before


def a_prefill_worker(mesh: Mesh) -> str:
    ids = sorted(w.heartbeat.worker_id for w in mesh.status().workers)
    return next(i for i in ids if i.startswith("prefill"))


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
    deadline = time.monotonic() + 60
    while len(tcp_mesh.status().workers) < 4 or victim in {
        w.heartbeat.worker_id for w in tcp_mesh.status().workers
    }:
        assert time.monotonic() < deadline, f"{victim} was not replaced"
        time.sleep(0.5)
    assert_blocks_return(tcp_mesh, 4)
