"""What a worker measures for the path choice: the engine's step shape and queued prompt
tokens, the step timer's EWMAs from fake step reports, the busy share, each decode peer's
link, and the TTFT of each first token it streams (reported in its next heartbeat)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
from opentelemetry.context import Context

from services.worker.config import WorkerConfig
from services.worker.engine_thread import EngineThread
from services.worker.prefill import PeerStats
from services.worker.requests import RequestState, Trace, WorkerRequest
from services.worker.step_costs import STALL_HORIZON_S, BusyShare, StepTimer
from services.worker.telemetry import WorkerTelemetry
from shared.engine.engine_config import EngineConfig
from shared.engine.outputs import RequestOutput, StepOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import ScheduledChunk
from shared.engine.sequence import Sequence
from shared.engine.stats import KVCacheEvents, min_stream_tokens, queued_prompt_tokens, step_shape
from shared.protocol import SubmitRequest


def seq(prompt: int, computed: int, outputs: int = 0) -> Sequence:
    tokens = list(range(prompt + outputs))
    sequence = Sequence("r", tokens, prompt, SamplingParams(), seed=0)
    sequence.num_computed_tokens = computed
    return sequence


def test_step_shape_tells_prompt_tokens_from_decode_rows():
    chunks = [
        ScheduledChunk(seq(10, 10, outputs=1), 1),  # a decode row
        ScheduledChunk(seq(10, 10, outputs=1), 3, draft_token_ids=[1, 2]),  # a verify row
        ScheduledChunk(seq(300, 0), 256),  # a prompt's first chunk
        ScheduledChunk(seq(300, 256), 44),  # and its last
    ]
    assert step_shape(chunks) == (300, 2)


def test_queued_prompt_tokens_count_waiting_and_prefilling_sequences():
    waiting = [seq(100, 0), seq(50, 0, outputs=7)]  # the second was preempted: recomputes all
    running = [seq(300, 256), seq(10, 10, outputs=1)]  # prefilling; decoding (not counted)
    assert queued_prompt_tokens(waiting, running) == 100 + 57 + 44


def test_step_timer_averages_prompt_rate_and_decode_steps():
    timer = StepTimer(alpha=0.5)
    assert timer.current.prefill_rate == 0.0
    timer.observe(0.1, prompt_tokens=256, decode_rows=0)
    assert timer.current.prefill_rate == pytest.approx(2560.0)
    timer.observe(0.3, prompt_tokens=256, decode_rows=2)  # a slower step: the rate falls
    # a ratio of averages: (256 + 256) / 2 over (0.1 + 0.3) / 2
    assert timer.current.prefill_rate == pytest.approx(256 / 0.2)
    assert timer.current.decode_step_s == 0.0  # no step without prompt tokens yet
    timer.observe(0.02, prompt_tokens=0, decode_rows=4)
    timer.observe(0.04, prompt_tokens=0, decode_rows=8)
    assert (timer.current.decode_step_s, timer.current.decode_batch) == pytest.approx((0.03, 6))
    timer.observe(5.0, prompt_tokens=0, decode_rows=0)  # scheduled nothing: no measure
    assert timer.current.busy_seconds == pytest.approx(0.1 + 0.3 + 0.02 + 0.04)


def test_the_stall_streams_took_is_summed_and_fades_over_a_streams_life():
    timer = StepTimer(alpha=1.0)
    timer.observe(0.02, prompt_tokens=0, decode_rows=4)  # a plain decode step: no stall
    timer.observe(1.0, prompt_tokens=512, decode_rows=0)  # no stream waited on it
    assert timer.current.stall_s == 0.0
    timer.observe(1.02, prompt_tokens=512, decode_rows=4)  # streams held 1 s past a step
    assert timer.current.stall_s == pytest.approx(1.0)
    timer.observe(STALL_HORIZON_S, prompt_tokens=0, decode_rows=4)  # time passes: it fades
    assert timer.current.stall_s == pytest.approx(1.0 / math.e)


def test_the_shortest_running_stream_is_the_one_a_stall_hurts_most():
    def running(max_tokens: int) -> Sequence:
        return Sequence("r", [1, 2, 3], 3, SamplingParams(max_tokens=max_tokens), seed=0)

    assert min_stream_tokens([running(256), running(64), running(128)]) == 64
    assert min_stream_tokens([]) == 0


def test_busy_share_of_each_interval():
    share = BusyShare()
    assert share.share(10.0, now=100.0) == 0.0  # nothing to compare with yet
    assert share.share(10.5, now=101.0) == pytest.approx(0.5)
    assert share.share(12.0, now=102.0) == 1.0  # clamped


class TimedEngine:
    """Three prompt steps of 128 tokens, ~10 ms each, then nothing."""

    def __init__(self) -> None:
        self.steps = 3
        self.last_step_num_tokens = 0

    def has_unfinished_requests(self) -> bool:
        return self.steps > 0

    def run_step(self) -> StepOutput:
        time.sleep(0.01)
        self.steps -= 1
        self.last_step_num_tokens = 128
        return StepOutput(num_prompt_tokens=128)

    def observe_costs(self, costs: object) -> None:
        pass  # no tier to tell

    def close(self) -> None:
        pass

    def stats(self) -> object:
        return object()

    def take_kv_events(self) -> KVCacheEvents:
        return KVCacheEvents()


def test_the_engine_thread_times_each_step():
    thread = EngineThread(TimedEngine, lambda step, started: None, lambda exc: None)

    async def main() -> None:
        await thread.start()
        deadline = time.monotonic() + 5
        while thread.timer.current.busy_seconds < 0.03 - 1e-3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await thread.stop()

    asyncio.run(main())
    costs = thread.timer.current
    assert costs.busy_seconds >= 0.03 - 1e-3
    assert 0 < costs.prefill_rate <= 128 / 0.01 * 1.01


def test_peer_stats_measure_each_link():
    peers = PeerStats(alpha=0.5)
    peers.sent("d1", "nixl", 64, 64_000_000, 0.040)
    peers.sent("d1", "nixl", 0, 0, 0.004)  # all cached on d1: only the fixed cost
    peers.sent("d2", "nats", 32, 32_000_000, 0.5)
    d1, d2 = peers.snapshot()
    assert (d1.blocks, d1.transfers, d1.latency) == (64, 2, 0.004)
    assert (d1.mean_bytes, d1.mean_seconds) == pytest.approx((32_000_000, 0.022))
    assert (d2.worker_id, d2.latency, d2.mean_seconds) == ("d2", 0.0, 0.5)


def make_request(submitted_at: float, *, decodes: bool, num_blocks: int = 0) -> WorkerRequest:
    request = SubmitRequest("r1", "g1", [1, 2, 3], SamplingParams(), 1e12)
    request.submitted_at = submitted_at
    entry = WorkerRequest(
        request, RequestState.ENGINE, 1e12, "s", 0, Trace(Context(), time.time()), decodes
    )
    entry.num_blocks = num_blocks
    return entry


def telemetry(role: str) -> WorkerTelemetry:
    engine = EngineConfig(model_dir=Path("/m"))
    return WorkerTelemetry(WorkerConfig(worker_id="w", role=role, model_name="m", engine=engine))


def test_first_tokens_streamed_here_are_reported_with_their_ttft():
    decode = telemetry("decode")
    sent = time.time() - 0.25
    own = make_request(sent, decodes=True)  # a DecodeTask: its first token is computed here
    decode.on_output(own, RequestOutput("r1", [7]), step_started=time.time())
    decode.on_output(own, RequestOutput("r1", [8]), step_started=time.time())  # not a first
    received = make_request(sent, decodes=True, num_blocks=4)  # its first came from prefill
    decode.on_output(received, RequestOutput("r1", [9]), step_started=time.time())
    untimed = make_request(0.0, decodes=True)  # a gateway that does not say when it sent
    decode.on_output(untimed, RequestOutput("r1", [7]), step_started=time.time())
    (first,) = decode.take_first_tokens()
    assert first.request_id == "r1"
    assert 0.25 <= first.ttft < 5.0
    assert decode.take_first_tokens() == []

    prefill = telemetry("prefill")
    prefill.on_first_token(make_request(100.0, decodes=False), RequestOutput("r1", [7]), 100.5)
    assert [(f.request_id, f.ttft) for f in prefill.take_first_tokens()] == [("r1", 0.5)]
