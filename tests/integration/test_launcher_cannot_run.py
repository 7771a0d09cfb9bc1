"""`up` stops once, with the child's own message, when a child exits saying it cannot run
its configuration (a flag its engine refuses): no crash loop."""

from __future__ import annotations

import sys
from pathlib import Path

from services.launch_plan import LauncherConfig
from services.supervisor import ChildSpec
from shared.ports import free_port
from tests.integration.test_launcher import lines, mesh_down, stand_in

ROOT = Path(__file__).resolve().parents[2]
MESSAGE = "--block-size 16: vLLM's CPU attention runs blocks of [MultipleOf(32)] tokens"
REFUSES = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from services.cannot_run import exit_cannot_run
open(sys.argv[1], "a").write("refusing\\n")
exit_cannot_run("worker", {MESSAGE!r})
"""


def test_a_worker_that_cannot_run_stops_up_with_its_message(tmp_path):
    config = LauncherConfig(
        home=tmp_path / "home",
        nats_port=free_port(),
        grace=0.5,
        restart_backoff=0.05,
        max_restarts_per_minute=5,
    )
    starts = tmp_path / "refusals"

    def children(nats_url: str) -> list[ChildSpec]:
        return [
            stand_in(tmp_path, "sched", "scheduler"),
            ChildSpec("prefill-0", "worker", (sys.executable, "-c", REFUSES, str(starts))),
            stand_in(tmp_path, "gw", "gateway"),
        ]

    down = mesh_down(config, children, timeout=30)
    assert str(down) == f"prefill-0 cannot run this configuration: {MESSAGE}"
    assert lines(starts) == ["refusing"]  # started once, never restarted
    assert lines(tmp_path / "stops") == ["gw", "sched"]  # the rest stopped, in order
