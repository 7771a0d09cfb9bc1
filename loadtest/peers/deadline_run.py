"""Run a command to a log file under a deadline; on the deadline, its whole process group goes.

`subprocess.run(timeout=...)` kills only the child it started: a build tool's compilers or
an engine's worker processes would live on. Here the command gets its own session, and a
timeout (or any exception while waiting, Ctrl-C included) kills that session's group.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_to_log(
    command: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None
) -> int:
    """The command's exit code; raises subprocess.TimeoutExpired past `timeout_s`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        child = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        try:
            return child.wait(timeout_s)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
