"""What the soak (test_soak.py) needs besides the mesh: the long-lived processes it watches
and strikes, their resident memory sampled over time, and the rule that says it stayed flat.

"Flat" (issue 60, case 7): a process is judged once it has lived `WARMUP_S` (its caches,
pools and first compilations fill) plus `JUDGED_AFTER_S`; its RSS at the end (median of
its last 3 samples) must stay within `GROWTH_SHARE` of its RSS at the end of its warm-up
(median of the 3 samples from then on) plus `GROWTH_MIB`. A process restarted by a fault is
a new process with a warm-up of its own.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.nats_server import NatsServer, find_binary

WARMUP_S = 120.0
JUDGED_AFTER_S = 300.0
GROWTH_SHARE = 0.10
GROWTH_MIB = 32


@dataclass(frozen=True, slots=True)
class Proc:
    ppid: int
    rss_kib: int
    argv: tuple[str, ...]


def scan() -> dict[int, Proc]:
    """Every process's parent, resident memory and command line, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            argv = tuple(a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0") if a)
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = int(fields.get("VmRSS", "0 kB").split()[0])
        found[int(entry.name)] = Proc(int(fields["PPid"]), rss, argv)
    return found


def label(argv: tuple[str, ...]) -> str:
    """A mesh process's name: `worker <id>`, `scheduler`, `gateway` or `up`."""
    if "--worker-id" in argv:
        return f"worker {argv[argv.index('--worker-id') + 1]}"
    for name in ("scheduler", "gateway", "up"):
        if name in argv:
            return name
    return " ".join(argv[:3])


def descendants(procs: dict[int, Proc], root: int) -> dict[int, str]:
    """`root` and every process under it, labelled."""
    found = {}
    for pid, proc in procs.items():
        up = pid
        while up > 1 and up != root:
            up = procs[up].ppid if up in procs else 0
        if up == root:
            found[pid] = label(proc.argv)
    return found


@dataclass(slots=True)
class MemoryLog:
    """RSS samples (seconds since the start, KiB) per process, by pid."""

    started: float = field(default_factory=time.monotonic)
    labels: dict[int, str] = field(default_factory=dict)
    samples: dict[int, list[tuple[float, int]]] = field(default_factory=dict)

    def sample(self, watched: dict[int, str], procs: dict[int, Proc]) -> None:
        now = time.monotonic() - self.started
        for pid, name in watched.items():
            if pid in procs:
                self.labels[pid] = name
                self.samples.setdefault(pid, []).append((now, procs[pid].rss_kib))

    def judged(self) -> list[tuple[str, int, int, int, bool]]:
        """(label, pid, warm KiB, end KiB, flat) of each process that lived long enough."""
        rows = []
        for pid, samples in self.samples.items():
            born = samples[0][0]
            warm = [kib for t, kib in samples if t >= born + WARMUP_S][:3]
            if samples[-1][0] - born < WARMUP_S + JUDGED_AFTER_S or not warm:
                continue
            start = int(statistics.median(warm))
            end = int(statistics.median(kib for _, kib in samples[-3:]))
            flat = end <= start * (1 + GROWTH_SHARE) + GROWTH_MIB * 1024
            rows.append((self.labels[pid], pid, start, end, flat))
        return sorted(rows)


def restart_node(server: NatsServer, timeout: float = 60.0) -> NatsServer:
    """The killed cluster node again, from its own config (same ports and routes). The
    timeout is long: on a machine short of memory (its page cache evicted, the OOM killer at
    work) exec-ing the server alone once took over 10 s."""
    log = (server.config_path.parent / "nats-server.log").open("ab")
    process = subprocess.Popen(
        [find_binary(), "-c", str(server.config_path)],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    node = NatsServer(process, server.port, server.config_path, server.monitor_port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nats-server exited with {process.returncode}: {log.name}")
        try:
            socket.create_connection(("127.0.0.1", node.port), timeout=0.2).close()
            return node
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nats-server did not listen on {node.port} again")
