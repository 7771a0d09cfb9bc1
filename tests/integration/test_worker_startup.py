"""A worker times its start phase by phase and reports it in its heartbeats and /metrics:
the engine's own phases (weights, KV cache), the KV transport's registration, the NATS
connection, and once a request ran, the first engine step."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from shared.engine.sampling_params import SamplingParams
from shared.engine.startup_phases import StartupPhase
from tests.integration.test_worker import Mesh, run_mesh, until

P = StartupPhase
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_heartbeats_and_metrics_carry_the_start_phase_by_phase(nats_server, tiny_model_dir):
    async def scenario(mesh: Mesh) -> None:
        await mesh.split(mesh.request("r1", GREEDY))
        await mesh.tokens("r1")

        def phases(worker: str) -> dict[StartupPhase, float]:
            beat = mesh.beats.get(worker)
            return {p.phase: p.seconds for p in beat.startup} if beat else {}

        await until(lambda: P.FIRST_STEP in phases("prefill") and P.FIRST_STEP in phases("decode"))
        for worker in ("prefill", "decode"):
            beat, seen = mesh.beats[worker], phases(worker)
            # every phase, the first step's included; the weights loaded (no packed cache
            # in tests: tests/conftest.py), so not mapped
            assert set(seen) == set(StartupPhase) - {P.WEIGHTS_MAPPED}
            assert [p.phase for p in beat.startup] == sorted(seen)  # in phase order
            assert min(seen.values()) >= 0 and seen[P.WEIGHTS_LOAD] > 0
            # The phases before serving are consecutive parts of the process's life so far
            # (its age is read in 10 ms ticks).
            before_ready = sum(s for p, s in seen.items() if p != P.FIRST_STEP)
            assert before_ready <= beat.ready_s + 0.05

        beat = mesh.beats["decode"]
        url = f"http://127.0.0.1:{beat.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            families = text_string_to_metric_families(reply.read().decode())
        gauge = {
            s.labels["phase"]: s.value
            for f in families
            for s in f.samples
            if s.name == "splitserve_worker_startup_seconds"
        }
        assert gauge["ready"] == beat.ready_s
        assert gauge["weights_load"] == phases("decode")[P.WEIGHTS_LOAD]

    run_mesh(nats_server.url, tiny_model_dir, scenario, metrics_port=0)
