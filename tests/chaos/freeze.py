"""What the freeze cases share: SIGSTOP a worker of a running `splitserve up` for a while
under load, and count what the mesh did about it (workers declared lost, migrations)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request

from tests.e2e.test_chaos import worker_pid
from tests.e2e.test_mesh import Mesh

MIGRATIONS = re.compile(r"^splitserve_request_migrations_total (\S+)$", re.M)


def migrations(mesh: Mesh) -> float:
    """The gateway's count of migrated requests so far."""
    with urllib.request.urlopen(f"{mesh.base}/metrics", timeout=10) as reply:
        found = MIGRATIONS.search(reply.read().decode())
    return float(found.group(1)) if found else 0.0


def declared_lost(mesh: Mesh, worker_id: str) -> int:
    """How many times the scheduler has declared `worker_id` lost (its log, in up's)."""
    return mesh.log_path.read_text().count(f"worker {worker_id} lost (")


def freezer(mesh: Mesh, worker_id: str, seconds: float) -> tuple[threading.Event, object]:
    """A fault for `run_load`: SIGSTOP the worker, SIGCONT it `seconds` later (in a thread,
    so the streams go on meanwhile); the event is set once it runs again."""
    resumed = threading.Event()

    def fault() -> None:
        pid = worker_pid(mesh, worker_id)
        os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            time.sleep(seconds)
            os.kill(pid, signal.SIGCONT)
            resumed.set()

        threading.Thread(target=resume, daemon=True).start()

    return resumed, fault
