"""Who holds a flock and whether it is stopped (services/worker/lock_holders.py): read from
/proc/locks and /proc/<pid>/stat; a waiter is no holder, an unreadable /proc knows none."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from services.worker.lock_holders import held_by_stopped, holders, lock_key, stopped


def test_the_holder_of_a_flock_is_found_and_a_running_one_is_not_stopped(tmp_path):
    fd = os.open(tmp_path / "core-0", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert holders(fd) == set()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert holders(fd) == {os.getpid()}
        assert not stopped(os.getpid()) and held_by_stopped(fd) is None
    finally:
        os.close(fd)


def fake_proc(root: Path, locks: str, states: dict[int, str]) -> Path:
    (root / "locks").write_text(locks)
    for pid, state in states.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(f"{pid} (py (x) y) {state} 1 2 3\n")
    return root


def test_a_stopped_holder_is_told_apart_from_a_waiter_and_a_running_one(tmp_path):
    fd = os.open(tmp_path / "core-1", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        key = lock_key(fd)
        locks = (
            f"1: FLOCK  ADVISORY  WRITE 41 {key} 0 EOF\n"
            f"1: -> FLOCK  ADVISORY  WRITE 42 {key} 0 EOF\n"
            f"2: FLOCK  ADVISORY  WRITE 43 00:00:1 0 EOF\n"
        )
        proc = tmp_path / "proc"
        proc.mkdir()
        fake_proc(proc, locks, {41: "T", 42: "T", 43: "T"})
        assert holders(fd, proc) == {41}  # 42 waits; 43 holds another file
        assert stopped(41, proc) and not stopped(44, proc)  # 44: no such process
        assert held_by_stopped(fd, proc) == 41
        (proc / "41" / "stat").write_text("41 (py) S 1 2 3\n")  # it was resumed
        assert held_by_stopped(fd, proc) is None
        assert holders(fd, tmp_path / "nowhere") == set()
    finally:
        os.close(fd)
