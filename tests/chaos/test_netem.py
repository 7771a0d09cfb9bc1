"""Issue 60, case 5: the KV path degraded, not cut. The mesh across network namespaces
(tests/e2e/test_netns.py's: KV by NIXL over UCX's TCP between distinct addresses); under
load the prefill worker's link gets delay, jitter, loss and a rate of 32 kbit/s (`tc netem`,
both directions; where the kernel has no netem, a token bucket (`tbf`) at that rate that
drops what queues past 100 ms: slow and lossy all the same). At that rate a prompt's KV
(the test model's 8 KiB blocks, 8 prompts at once) outlasts the gateway's stall timeout
(5 s here): the hand-offs fail, the gateway migrates (checked: its migrations counter
moves), and each request whose KV did not arrive is placed where it needs no KV link: it
prefills where it decodes (services/scheduler/hand_offs.py). Every request completes, none
fails or hangs, and each is the engine's own text. Needs root and `ip netns`."""

from __future__ import annotations

import subprocess
import urllib.request

import pytest

from tests.e2e.test_chaos import assert_same_texts, make_jobs, reference, report, run_load
from tests.e2e.test_mesh import mesh_model_dir  # noqa: F401 (a fixture)
from tests.e2e.test_netns import STREAMS, Spread, spread  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]
NETEM = ["netem", "delay", "40ms", "20ms", "loss", "3%", "rate", "32kbit"]
TBF = ["tbf", "rate", "32kbit", "burst", "4kb", "latency", "100ms"]
MIGRATIONS = "splitserve_request_migrations_total"
ENDS = (([], "ss-p0-h"), (["ip", "netns", "exec", "ss-p0"], "ss-p0-n"))


def tc(prefix: list[str], *args: str) -> bool:
    done = subprocess.run([*prefix, "tc", "qdisc", *args], capture_output=True, timeout=60)
    return done.returncode == 0


def degrade() -> str:
    """Degrade the prefill worker's veth pair, both ends; says how."""
    kind = NETEM if tc([], "add", "dev", "ss-p0-h", "root", *NETEM) else TBF
    for prefix, device in ENDS:
        if prefix or kind is TBF:
            assert tc(prefix, "add", "dev", device, "root", *kind), f"tc {kind[0]} on {device}"
    return " ".join(kind)


def restore() -> None:
    for prefix, device in ENDS:
        tc(prefix, "del", "dev", device, "root")


def migrations(mesh: Spread) -> float:
    """The gateway's count of migrated attempts (its /metrics)."""
    with urllib.request.urlopen(f"{mesh.base}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(MIGRATIONS))


def test_a_degraded_kv_path_slows_requests_and_loses_none(spread, mesh_model_dir):  # noqa: F811
    jobs = make_jobs(51)[:STREAMS]
    expected = reference(mesh_model_dir, jobs)
    how: list[str] = []
    before = migrations(spread)
    try:
        outcomes = run_load(spread, jobs, lambda: how.append(degrade()), after_chunks=0, limit=120)
    finally:
        restore()
    moved = migrations(spread) - before
    _, failed, hung = report(f"netns KV path degraded ({how[0]}), {moved:.0f} migrations", outcomes)
    assert moved > 0, "no hand-off failed: the link was not degraded enough to test anything"
    assert (failed, hung) == (0, 0), [o.error for o in outcomes]
    assert_same_texts(jobs, outcomes, expected)
