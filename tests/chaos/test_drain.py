"""Issue 60, case 4: a decode worker drained (SIGTERM: scale-down, rollout) under load,
through `splitserve up`. It takes no new work, finishes its streams within the grace
period and exits 0: zero failed, every stream identical to the engine's. (A prefill worker
drained under load, which keeps its KV held until it has been read: tests/e2e/test_chaos.py
`test_prefill_worker_sigterm_drains_and_exits_0`.)"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.e2e.test_chaos import (
    STREAMS,
    assert_same_texts,
    make_jobs,
    reference,
    report,
    run_load,
    worker_pid,
)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]


@pytest.fixture(scope="module")
def one_by_two(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    home = tmp_path_factory.mktemp("chaos-drain")
    flags = ["--prefill", "1", "--decode", "2", "--path-choice", "fixed"]
    yield from start_mesh(mesh_model_dir, home, flags)


def test_a_decode_worker_drained_under_load_fails_nothing(one_by_two, mesh_model_dir):  # noqa: F811
    jobs = make_jobs(41)
    expected = reference(mesh_model_dir, jobs)
    pid = worker_pid(one_by_two, "decode-0")
    outcomes = run_load(one_by_two, jobs, lambda: os.kill(pid, signal.SIGTERM), after_chunks=10)
    done, failed, hung = report("decode SIGTERM (drain)", outcomes)
    assert (done, failed, hung) == (STREAMS, 0, 0), [o.error for o in outcomes]
    assert_same_texts(jobs, outcomes, expected)
    deadline = time.monotonic() + 40
    while "worker decode-0 exited with" not in one_by_two.log_path.read_text():
        assert time.monotonic() < deadline, "decode-0 did not exit"
        time.sleep(0.2)
    assert "worker decode-0 exited with 0" in one_by_two.log_path.read_text()
