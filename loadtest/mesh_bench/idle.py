"""`splitserve bench idle`: the CPU an idle mesh burns.

Starts `splitserve up` (flags passed through), waits for `/ready` and a settling pause, then
reads the CPU time (user + system, from /proc) of every process of the mesh — the launcher,
nats-server, scheduler, gateway and workers — over a window with no request, and prints it
per process and in all, as seconds and as a share of one core. An idle mesh should cost
little more than its heartbeats.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.mesh import MeshProcess

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class IdleBenchConfig:
    model_dir: Path
    seconds: float = 30.0
    settle_seconds: float = 5.0
    up_args: tuple[str, ...] = ()
    log: Path = Path("artifacts/bench/idle-mesh.log")


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (the launcher starts each child in its own session,
    so the tree is found by parent ids, not by process group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(int(stat[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each pid still alive."""
    times = {}
    for pid in pids:
        stat = _stat(pid)
        if stat is not None:
            times[pid] = (int(stat[11]) + int(stat[12])) / TICKS
    return times


def describe(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    words = [a.decode(errors="replace") for a in argv if a]
    if "services.cli" in words:
        rest = words[words.index("services.cli") + 1 :]
        if rest[:1] == ["worker"] and "--worker-id" in rest:
            return f"worker {rest[rest.index('--worker-id') + 1]}"
        return rest[0] if rest else "services.cli"
    return Path(words[0]).name if words else str(pid)


def run_idle_bench(config: IdleBenchConfig) -> float:
    """Print the idle mesh's CPU use; returns the total CPU seconds over the window."""
    mesh = MeshProcess(config.model_dir, list(config.up_args), config.log)
    try:
        mesh.wait_ready()
        time.sleep(config.settle_seconds)
        pids = process_tree(mesh.process.pid)
        names = {pid: describe(pid) for pid in pids}
        before, started = cpu_seconds(pids), time.monotonic()
        time.sleep(config.seconds)
        after, wall = cpu_seconds(pids), time.monotonic() - started
    finally:
        mesh.stop()
    used = {pid: after[pid] - before[pid] for pid in after if pid in before}
    print(f"idle mesh, {wall:.1f} s with no request (splitserve up {' '.join(config.up_args)})")
    for pid, seconds in sorted(used.items(), key=lambda item: -item[1]):
        print(f"  {names[pid]:<24} {seconds:7.2f} s CPU  {100 * seconds / wall:6.1f}% of a core")
    total = sum(used.values())
    print(f"  {'all':<24} {total:7.2f} s CPU  {100 * total / wall:6.1f}% of a core")
    return total


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 1 is the parent's pid)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()
