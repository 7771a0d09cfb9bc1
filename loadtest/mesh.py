"""Start `splitserve up` as a process group on loopback ports, wait for `/ready`, stop it.

`wait_http_ready` and `stop_group` serve any server started as its own process group (the
peers of `splitserve bench peers` too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.ports import free_port


class MeshProcess:
    def __init__(self, model_dir: Path, extra: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "services.cli", "up", "--model-dir", str(model_dir),
            "--port", str(self.port), "--nats-port", str(free_port()), *extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_http_ready(self.process, f"{self.url}/ready", timeout_s, "the mesh", self.log_path)

    def stop(self) -> None:
        stop_group(self.process)


def wait_http_ready(
    process: subprocess.Popen,
    url: str,
    timeout_s: float,
    name: str,
    log_path: Path,
    poll_s: float = 0.5,
) -> None:
    """Until `url` answers 200: RuntimeError when the process exits first, TimeoutError after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{name} not ready in {timeout_s:.0f} s; see {log_path}")


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process's group, SIGKILL after 60 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
