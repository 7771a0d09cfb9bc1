"""Issue 60, case 2: a worker frozen (SIGSTOP) under load, through `splitserve up`.

Frozen for less than heartbeat + probe timeout (the machine only busy; longer than the
heartbeat timeout alone, which used to be enough for a WorkerLost): no worker is declared
lost and nothing migrates; every stream completes, seeded ones identical to the engine.
Frozen for longer than heartbeat + probe timeout (`chaos`, `make chaos`): it is declared
lost, its streams migrate and complete once, identical; on SIGCONT it drops what the mesh
moved elsewhere, rejoins, and every worker ends with all its blocks free (nothing held
twice, no stale reservation left)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.chaos.freeze import declared_lost, freezer, migrations
from tests.e2e.test_chaos import (
    STREAMS,
    assert_blocks_return,
    assert_same_texts,
    make_jobs,
    reference,
    report,
    run_load,
)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HEARTBEAT_TIMEOUT = 3.0  # the scheduler's defaults
PROBE_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def one_by_two(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    home = tmp_path_factory.mktemp("chaos-freeze")
    flags = ["--prefill", "1", "--decode", "2", "--path-choice", "fixed"]
    yield from start_mesh(mesh_model_dir, home, flags)


def test_a_freeze_the_probe_outlasts_migrates_nothing(one_by_two, mesh_model_dir):  # noqa: F811
    jobs = make_jobs(21)[:8]
    expected = reference(mesh_model_dir, jobs)
    before = migrations(one_by_two)
    resumed, freeze = freezer(one_by_two, "decode-0", HEARTBEAT_TIMEOUT + 1.5)
    outcomes = run_load(one_by_two, jobs, freeze, after_chunks=5)
    assert resumed.wait(15)
    assert report("decode SIGSTOP 4.5 s", outcomes)[0] == len(jobs)
    assert_same_texts(jobs, outcomes, expected)
    assert declared_lost(one_by_two, "decode-0") == 0
    assert migrations(one_by_two) == before
    assert_blocks_return(one_by_two, 3)


@pytest.mark.chaos
def test_a_long_freeze_migrates_once_and_the_worker_rejoins(one_by_two, mesh_model_dir):  # noqa: F811
    jobs = make_jobs(22)
    expected = reference(mesh_model_dir, jobs)
    lost_before = declared_lost(one_by_two, "decode-0")
    frozen_for = HEARTBEAT_TIMEOUT + PROBE_TIMEOUT + 3.0
    resumed, freeze = freezer(one_by_two, "decode-0", frozen_for)
    outcomes = run_load(one_by_two, jobs, freeze, after_chunks=10)
    assert resumed.wait(frozen_for + 10)
    assert report("decode SIGSTOP 9 s", outcomes)[0] == STREAMS
    assert [o.finish for o in outcomes] == ["length"] * STREAMS
    assert_same_texts(jobs, outcomes, expected)
    assert declared_lost(one_by_two, "decode-0") == lost_before + 1
    deadline = time.monotonic() + 20
    while "decode-0" not in {w.heartbeat.worker_id for w in one_by_two.status().workers}:
        assert time.monotonic() < deadline, "decode-0 did not rejoin"
        time.sleep(0.5)
    assert_blocks_return(one_by_two, 3)
