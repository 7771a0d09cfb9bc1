"""Who holds a `flock`, and whether that process is stopped (Linux: /proc/locks, /proc/<pid>/stat).

The core lease (core_lease.py) waits for a worker's home core while another worker's step
holds it. A process stopped mid-step (SIGSTOP: a frozen worker, a debugger) keeps its locks
for as long as it is stopped; waiting on it stalls every worker sharing that core. This
says when the wait is on such a process.

The one subtle rule: /proc/locks names the process that took a lock; a line with `->` is a
process waiting for one, not holding it. Where /proc is not readable, nothing is known and
no holder is reported stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def lock_key(fd: int) -> str:
    """The file of `fd` as /proc/locks names it: `major:minor:inode` (hex, hex, decimal)."""
    st = os.fstat(fd)
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


def holders(fd: int, proc: Path = PROC) -> set[int]:
    """The pids holding a flock on the file `fd` opens."""
    key = lock_key(fd)
    try:
        lines = (proc / "locks").read_text().splitlines()
    except OSError:
        return set()
    # "3: FLOCK  ADVISORY  WRITE 30222 00:1b:12 0 EOF"; a waiter's: "3: -> FLOCK ..."
    found = set()
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
            found.add(int(fields[4]))
    return found


def stopped(pid: int, proc: Path = PROC) -> bool:
    """Whether process `pid` is stopped (state T: SIGSTOP; t: stopped by a tracer)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    after_name = stat.rpartition(")")[2].split()  # the name may hold spaces and parentheses
    return bool(after_name) and after_name[0] in ("T", "t")


def held_by_stopped(fd: int, proc: Path = PROC) -> int | None:
    """A stopped process holding the flock on `fd`'s file, if one does (its pid)."""
    return next((pid for pid in sorted(holders(fd, proc)) if stopped(pid, proc)), None)
