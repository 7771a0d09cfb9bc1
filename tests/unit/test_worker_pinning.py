"""A worker pinned to its own cores (`--cpus`): the core list's syntax, the pin of every thread
of the process (those it had and those it starts), a thread per core in its engine (so no
core lease), and a core the machine lacks refused as a config error."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cannot_run import CANNOT_RUN
from services.worker import cli as worker_cli
from services.worker.pinning import cpu_list, parse_cpus, usable_cpus
from shared.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser.parse_args(["--model-dir", "/m", *argv])


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", ()), ("0", (0,)), ("0-1", (0, 1)), ("2,0", (0, 2)), (" 0-2, 5 ", (0, 1, 2, 5))],
)
def test_a_core_list_reads_cores_and_ranges(text, cpus):
    assert parse_cpus(text) == cpus
    assert parse_cpus(cpu_list(cpus)) == cpus


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a", "not a core"),
        ("1-", "not a core"),
        ("-1", "not a core"),
        ("0,,1", "not a core"),
        ("3-1", "runs backwards"),
        ("0,0-1", "named twice"),
    ],
)
def test_a_bad_core_list_is_a_config_error(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_cpus(text)


def test_cpu_list_writes_ranges():
    assert cpu_list([5, 0, 1, 2]) == "0-2,5"
    assert cpu_list([3]) == "3"


def test_pin_moves_every_thread_of_the_process_onto_the_cores():
    core = usable_cpus()[-1]
    code = f"""
import os, threading
from services.worker.pinning import pin
seen = {{}}
started = threading.Event()
def before():
    started.wait()
    seen["before"] = os.sched_getaffinity(0)
thread = threading.Thread(target=before)
thread.start()
pin(({core},))
started.set()
thread.join()
after = threading.Thread(target=lambda: seen.update(after=os.sched_getaffinity(0)))
after.start()
after.join()
seen["main"] = os.sched_getaffinity(0)
assert seen == {{"before": {{{core}}}, "after": {{{core}}}, "main": {{{core}}}}}, seen
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert len(os.sched_getaffinity(0)) == len(usable_cpus())  # this process: untouched


def test_a_pinned_worker_runs_a_thread_per_core_unless_told_otherwise(monkeypatch):
    config = worker_cli.config_from_args(worker_args("--cpus", "0-1"))
    assert (config.pinned_cpus, config.engine_config().num_threads) == ((0, 1), 2)
    assert config.engine.num_threads is None  # the flag itself stays as given
    given = worker_cli.config_from_args(worker_args("--cpus", "0", "--num-threads", "3"))
    assert given.engine_config().num_threads == 3
    unpinned = worker_cli.config_from_args(worker_args())
    assert (unpinned.pinned_cpus, unpinned.engine_config().num_threads) == ((), None)
    monkeypatch.setenv("SPLITSERVE_CPUS", "1")
    assert worker_cli.config_from_args(worker_args()).pinned_cpus == (1,)


def test_the_worker_refuses_a_bad_list_or_a_core_the_machine_lacks(capsys):
    for cpus, message in (("0-x", "cpus '0-x'"), ("100000", "cpus 100000: not among")):
        with pytest.raises(SystemExit) as exited:
            worker_cli.main(worker_args("--cpus", cpus))
        assert exited.value.code == CANNOT_RUN
        assert f"splitserve worker: cannot run: {message}" in capsys.readouterr().err
