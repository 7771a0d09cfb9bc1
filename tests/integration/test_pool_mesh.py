"""Pools that follow the load under `splitserve up` (processes, real nats-server, tiny random
model with the real tokenizer): a worker started as decode changes role under the
credentials `up` made (every worker connects as `both`); `splitserve scale` brings a new
worker up, which joins the scheduler: `up`'s standby worker (services/standby.py), found by
its command line as any worker is; a lower target drains the worker holding a stream,
which finishes with the exact tokens of an undisturbed run, and the drained worker is not
restarted."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.role_cli import RoleCommand, change_role
from services.standby import READY_LINE
from shared.bus import Bus
from shared.config import CommonConfig
from shared.pool_messages import PoolTarget
from shared.protocol import MeshStatus
from shared.subjects import Subjects
from tests.e2e.conftest import real_model_dir  # noqa: F401  (fixture)
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STREAM = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0.8, "seed": 7}


@pytest.fixture(scope="module")
def mesh(mesh_model_dir, tmp_path_factory):  # noqa: F811  (the fixture)
    flags = ["--max-workers", "3", "--path-choice", "fixed"]  # prefill-0, decode-0
    yield from start_mesh(mesh_model_dir, tmp_path_factory.mktemp("home"), flags)


def common(mesh: Mesh, user: str) -> CommonConfig:
    """Connection settings as `user`, with the credentials `up` made for its nats-server."""
    return CommonConfig(
        nats_url=f"nats://127.0.0.1:{mesh.nats_port}", nats_auth=mesh.credentials.auth(user)
    )


def serving(status: MeshStatus) -> dict[str, str]:
    """Worker id → role, of the workers not draining and not mid-change."""
    beats = [w.heartbeat for w in status.workers]
    return {b.worker_id: b.role for b in beats if not (b.draining or b.next_role)}


def wait_for(condition, timeout: float = 60.0, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
    return result


def stream_text(mesh: Mesh, model: str) -> tuple[str, int]:
    stream = mesh.client.completions.create(
        model=model, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, **STREAM,
    )  # fmt: skip
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    return "".join(pieces), usage.completion_tokens


def pids_with(parent: int, *args: str) -> list[int]:
    """`parent`'s children whose command line (/proc/PID/cmdline, split on NUL) holds `args`
    in a row."""
    wanted = [a.encode() for a in args]
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if argv else 0
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and any(argv[i : i + len(wanted)] == wanted for i in range(len(argv))):
            found.append(int(entry.name))
    return found


def publish(mesh: Mesh, pool_target: PoolTarget) -> None:
    async def send() -> None:
        settings = common(mesh, "planner")
        bus = await Bus.connect(settings.nats_url, "test-planner", auth=settings.nats_auth)
        await bus.publish(Subjects().pool_target, pool_target)
        await bus.close()

    asyncio.run(send())


def test_roles_change_workers_join_and_a_drained_worker_finishes_its_stream(mesh):
    model = mesh.client.models.list().data[0].id
    # decode-0 started as decode; `up` connected it as `both`, so it may serve any role.
    command = RoleCommand(worker="decode-0", role="both", wait=60, common=common(mesh, "scheduler"))
    ok, message = asyncio.run(change_role(command))
    assert ok, message

    log_text = mesh.log_path.read_text
    ready = wait_for(lambda: re.search(rf"{READY_LINE} \(pid (\d+)\)", log_text()), timeout=180)
    standby_pid = int(ready.group(1))
    argv = [sys.executable, "-m", "services.cli", "scale", "--role", "decode", "--replicas", "1"]
    argv += ["--nats", f"nats://127.0.0.1:{mesh.nats_port}", "--nats-user", "planner"]
    argv += ["--nats-password-file", str(mesh.credentials.password_file("planner"))]
    scaled = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    assert serving(mesh.status()) == {
        "prefill-0": "prefill",
        "decode-0": "both",
        "decode-1": "decode",
    }
    assert "adding worker decode-1 (decode) for pool target scale #" in mesh.log_path.read_text()
    assert f"started worker decode-1 (role worker) pid {standby_pid} from the standby" in (
        mesh.log_path.read_text()
    )
    # the standby it was shows the worker's command line, as ps and pgrep -f read it
    assert pids_with(mesh.process.pid, "--worker-id", "decode-1") == [standby_pid]
    shown = Path(f"/proc/{standby_pid}/cmdline").read_bytes().split(b"\0")
    assert [a.decode() for a in shown if a][:6] == [
        *(sys.executable, "-m", "services.cli", "worker", "--role", "decode")
    ]

    expected = stream_text(mesh, model)  # undisturbed
    got: list[tuple[str, int]] = []
    streaming = threading.Thread(target=lambda: got.append(stream_text(mesh, model)))
    streaming.start()
    try:
        holder = wait_for(
            lambda: [w.heartbeat for w in mesh.status().workers if w.heartbeat.num_running],
            every=0.1,
        )[0]
        other = {"both": "decode", "decode": "both"}[holder.role]
        wanted = {"prefill": 1, holder.role: 0, other: 1}
        publish(mesh, PoolTarget("planner-test", 1, "", **wanted, reason="test: drain"))
        wait_for(
            lambda: any(w.heartbeat.worker_id == holder.worker_id and w.heartbeat.draining
                        for w in mesh.status().workers),
            every=0.1,
        )  # fmt: skip
        assert streaming.is_alive(), "the stream ended before its worker drained: make it longer"
    finally:
        streaming.join(120)
    assert got == [expected]  # exact tokens across the drain
    assert expected[1] == STREAM["max_tokens"]
    log = mesh.log_path.read_text()
    assert (
        f"draining worker {holder.worker_id} ({holder.role}) for pool target planner-test #1" in log
    )
    assert "test: drain" in log
    wait_for(
        lambda: f"worker {holder.worker_id} drained and exited with" in mesh.log_path.read_text()
    )
    time.sleep(3)  # a restart would have registered by now
    ids = [w.heartbeat.worker_id for w in mesh.status().workers]
    assert not [i for i in ids if i.startswith(f"{holder.worker_id}-r")]
    left = {w for w in ("decode-0", "decode-1") if w != holder.worker_id}
    assert set(serving(mesh.status())) == {"prefill-0", *left}
