"""The planner's window: heartbeats in, MeshSignals out (the latest beat per worker, TTFT and
TPOT p99 over the samples of the last `window_s` seconds, silent workers left out); and the
worker's side of TPOT: each stream that ends well reports its time per output token."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from opentelemetry.context import Context

from services.planner.signals import WorkerSignal
from services.planner.window import SignalWindow, p99, worker_signal
from services.worker.config import WorkerConfig
from services.worker.requests import RequestState, Trace, WorkerRequest
from services.worker.telemetry import WorkerTelemetry
from shared.engine.engine_config import EngineConfig
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.protocol import FirstToken, Heartbeat, SubmitRequest


def beat(worker_id: str, role: str = "decode", running: int = 0, **fields) -> Heartbeat:
    return Heartbeat(worker_id, role, "m", running, 0, 100, 100, 16, **fields)


def test_p99_is_the_nearest_rank():
    assert p99([]) == 0.0
    assert p99([0.5]) == 0.5
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0
    assert p99([3.0, 1.0, 2.0]) == 3.0


def test_a_heartbeat_becomes_its_worker_signal():
    signal = worker_signal(
        Heartbeat(
            "w1", "decode", "m", num_running=3, num_waiting=1, free_blocks=25, total_blocks=100,
            block_size=16, draining=True, queued_prompt_tokens=40, busy=0.7, prefill_rate=900.0,
            decode_step_s=0.02, next_role="both",
        )
    )  # fmt: skip
    assert signal == WorkerSignal(
        "w1", "decode", "both", True, 3, 1, 40, kv_usage=0.75, busy=0.7, prefill_rate=900.0,
        decode_step_s=0.02,
    )  # fmt: skip


def test_percentiles_cover_the_window_only():
    window = SignalWindow(window_s=60.0, stale_s=3.0)
    window.add(beat("d0", first_tokens=[FirstToken("a", 9.0)], stream_tpots=[0.5]), now=0.0)
    window.add(beat("d0", first_tokens=[FirstToken("b", 0.2)], stream_tpots=[0.02]), now=50.0)
    window.add(beat("d0", stream_tpots=[0.03, 0.01]), now=55.0)
    early = window.snapshot(now=56.0)
    assert (early.ttft_p99, early.ttft_samples, early.tpot_p99, early.tpot_samples) == (
        9.0, 2, 0.5, 4,
    )  # fmt: skip
    late = window.snapshot(now=70.0)  # the beat at 0 s is out of the window
    assert (late.ttft_p99, late.ttft_samples, late.tpot_p99, late.tpot_samples) == (
        0.2, 1, 0.03, 3,
    )  # fmt: skip


def test_each_worker_is_its_latest_beat_and_a_silent_one_is_left_out():
    window = SignalWindow(window_s=60.0, stale_s=3.0)
    window.add(beat("d0", running=1), now=0.0)
    window.add(beat("p0", role="prefill"), now=1.0)
    window.add(beat("d0", running=5), now=2.0)
    now = window.snapshot(now=4.5)  # p0 last beat 3.5 s ago
    assert [(w.worker_id, w.num_running) for w in now.workers] == [("d0", 5)]
    assert now.now == 4.5


def test_only_the_planned_models_workers_count():
    window = SignalWindow(window_s=60.0, stale_s=3.0, model="m")
    window.add(beat("d0"), now=0.0)
    other = Heartbeat("x0", "decode", "other", 0, 0, 10, 10, 16, stream_tpots=[9.0])
    window.add(other, now=0.0)
    signals = window.snapshot(now=1.0)
    assert [w.worker_id for w in signals.workers] == ["d0"]
    assert signals.tpot_samples == 0


def telemetry() -> WorkerTelemetry:
    engine = EngineConfig(model_dir=Path("/m"))
    return WorkerTelemetry(
        WorkerConfig(worker_id="w", role="decode", model_name="m", engine=engine)
    )


def decoding(num_blocks: int = 4) -> WorkerRequest:
    request = SubmitRequest("r1", "g1", [1, 2, 3], SamplingParams(), 1e12)
    trace = Trace(Context(), time.time())
    entry = WorkerRequest(request, RequestState.ENGINE, 1e12, "s", 0, trace, True)
    entry.num_blocks = num_blocks
    return entry


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_stream_that_ends_well_reports_its_time_per_output_token(reason: str):
    tele, entry = telemetry(), decoding()
    for token in (5, 6, 7, 8, 9):
        tele.on_output(entry, RequestOutput("r1", [token]), step_started=time.time())
    started = entry.trace.first_output
    assert started > 0
    tele.on_end(entry, reason, started + 0.4)  # 4 tokens after the first, in 0.4 s
    assert tele.take_stream_tpots() == [pytest.approx(0.1)]
    assert tele.take_stream_tpots() == []


def test_failed_one_token_and_prefill_side_streams_report_no_tpot():
    tele = telemetry()
    failed, single = decoding(), decoding()
    for token in (5, 6, 7):
        tele.on_output(failed, RequestOutput("r1", [token]), step_started=time.time())
    tele.on_output(single, RequestOutput("r1", [5]), step_started=time.time())
    tele.on_end(failed, "abort", time.time() + 1)
    tele.on_end(single, "stop", time.time() + 1)
    prefill_side = decoding()
    prefill_side.decodes = False
    tele.on_output(prefill_side, RequestOutput("r1", [5]), step_started=time.time())
    tele.on_end(prefill_side, "stop", time.time() + 1)
    assert tele.take_stream_tpots() == []
