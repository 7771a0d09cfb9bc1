"""Start `splitserve up` as a process group on loopback ports, wait for `/ready`, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.nats_server import free_port


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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"splitserve up exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"mesh not ready in {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
