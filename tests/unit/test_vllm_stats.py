"""The vLLM worker's step costs from vLLM's iteration records: a step is the time between
two records while requests ran, its prompt tokens those computed, its decode rows the
generated tokens less the first tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make install ENGINE=vllm)")

from vllm.v1.metrics.stats import IterationStats, PromptTokenStats, SchedulerStats

from services.worker.vllm_stats import CounterLogger, VllmCounters


def record(
    logger: CounterLogger,
    at: float,
    running: int,
    computed: int = 0,
    generated: int = 0,
    first_tokens: int = 0,
) -> None:
    iteration = IterationStats()
    iteration.iteration_timestamp = at
    iteration.prompt_token_stats = PromptTokenStats(computed=computed, total=computed)
    iteration.num_generation_tokens = generated
    iteration.time_to_first_tokens_iter = [0.1] * first_tokens
    logger.record(SchedulerStats(num_running_reqs=running), iteration)


def logger() -> CounterLogger:
    return CounterLogger.factory(VllmCounters())(None)  # type: ignore[arg-type]


def test_steps_between_records_while_requests_ran_give_the_rate_and_the_decode_step():
    log = logger()
    record(log, 100.0, running=1)  # the first record times nothing
    record(log, 100.5, running=2, computed=500, generated=1, first_tokens=1)
    for i in range(1, 6):
        record(log, 100.5 + 0.03 * i, running=2, generated=2)
    costs = log.counters.timer.current
    assert costs.prefill_rate == pytest.approx(1000.0)
    assert costs.decode_step_s == pytest.approx(0.03)
    assert costs.decode_batch == pytest.approx(2.0)


def test_an_idle_gap_is_no_step():
    log = logger()
    record(log, 10.0, running=1, generated=1)
    record(log, 10.04, running=0, generated=1)  # the last request finished here
    record(log, 60.0, running=1, computed=100, generated=1, first_tokens=1)  # 50 s idle
    costs = log.counters.timer.current
    assert costs.decode_step_s == pytest.approx(0.04)
    assert costs.prefill_rate == 0.0 and costs.busy_seconds == pytest.approx(0.04)


def test_a_step_that_prefilled_beside_running_streams_counts_their_stall():
    log = logger()
    record(log, 0.0, running=2)
    record(log, 0.03, running=2, generated=2)  # a decode step of 30 ms
    record(log, 0.53, running=3, computed=256, generated=3, first_tokens=1)  # 2 rows waited
    assert log.counters.timer.current.stall_s == pytest.approx(0.47, abs=0.01)
