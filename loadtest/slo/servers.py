"""The servers `splitserve bench slo` compares, on this machine, one at a time:
`splitserve up --pool ROLE:CPUS ...` (loadtest/mesh.py: MeshProcess) for a configuration, and
vLLM-CPU (loadtest/peers/servers.py) for a peer row, run under `taskset -c CPUS` with its
OpenMP threads bound to the same cores, so both hold the cores the row's cost counts.

The one subtle rule: a configuration's workers are pinned by `up` itself (`--cpus` on each);
its nats-server, scheduler and gateway are not, and run where the machine puts them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from loadtest.mesh import MeshProcess
from loadtest.peers.servers import PeerProcess, ServerCommand, vllm_command, vllm_env
from loadtest.slo.config import Configuration
from services.worker.pinning import cpu_list
from shared.ports import free_port


class _Process(Protocol):
    url: str

    def wait_ready(self, timeout_s: float) -> None: ...
    def stop(self) -> None: ...


def taskset_command(command: ServerCommand, cpus: tuple[int, ...]) -> ServerCommand:
    """`command` run by `taskset -c CPUS`: it and every process it starts on `cpus` alone."""
    return ServerCommand(
        ["taskset", "-c", cpu_list(cpus), *command.argv], command.env, command.ready_path
    )


@dataclass
class LocalServers:
    model_dir: Path
    logs: Path  # one log file per row
    up_args: tuple[str, ...] = ()  # more flags for every `splitserve up`
    start_timeout_s: float = 600.0
    vllm_python: Path | None = None  # the peers' venv python, for a vLLM row
    vllm_kv_cache_gib: int = 1
    _running: _Process | None = field(default=None, init=False)  # the row started last

    async def start(self, config: Configuration) -> str:
        log = self.logs / f"{config.name}.log"
        if config.server == "vllm":
            if self.vllm_python is None:
                raise RuntimeError("a vLLM row needs the peers' venv (--peer vllm sets it up)")
            port = free_port()
            env = vllm_env(list(config.cpus), self.vllm_kv_cache_gib)
            command = vllm_command(self.vllm_python, self.model_dir, config.name, port, env)
            process: _Process = PeerProcess(
                config.name, taskset_command(command, config.cpus), port, log
            )
        else:
            process = MeshProcess(self.model_dir, [*config.up_args(), *self.up_args], log)
        self._running = process
        await asyncio.to_thread(process.wait_ready, self.start_timeout_s)
        return process.url

    async def stop(self) -> None:
        if self._running is not None:
            process, self._running = self._running, None
            await asyncio.to_thread(process.stop)
