"""vLLM's NIXL agent as our vLLM workers build it (vllm_nixl_connector.py): its progress
thread waits for work instead of spinning on a core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make install ENGINE=vllm)")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, base_worker

if base_worker.NixlWrapper is None:
    pytest.skip("NIXL is not installed here", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
# vLLM's own agent (as its NixlConnector makes it: UCX, 4 threads, the progress thread),
# then the CPU this process spends in 2 s of doing nothing.
IDLE_AGENT = """
import sys, time
if sys.argv[1] == "ours":
    import services.worker.vllm_nixl_connector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
config = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
agent = base_worker.NixlWrapper("idle", config)
time.sleep(0.3)
start = time.process_time()
time.sleep(2.0)
print("CPU", time.process_time() - start)
"""


def idle_cpu_seconds(which: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", IDLE_AGENT, which],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("CPU ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return float(lines[0].removeprefix("CPU "))


def test_the_connector_keeps_vllms_class_and_name():
    from services.worker import vllm_nixl_connector

    assert vllm_nixl_connector.NixlConnector is NixlConnector


@pytest.mark.slow
def test_an_idle_agent_no_longer_spins_its_progress_thread():
    ours = idle_cpu_seconds("ours")
    assert ours < 0.3, f"{ours:.2f} CPU-seconds in 2 s idle"
    # vLLM's own: the thread polls with no wait (a whole core where it gets one).
    assert idle_cpu_seconds("vllm") > 3 * ours + 0.2
