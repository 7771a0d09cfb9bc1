"""vLLM's own scheduler and iteration stats, kept as the counters our heartbeats carry.

vLLM calls `record` on the worker's event loop after each engine step it hears of
(`StatLoggerBase`, vllm/v1/metrics/loggers.py). The prefix-cache counters count what the
engine did not compute: a prompt token is a hit when it came from the local prefix cache
or from a peer's KV (vLLM's `external_kv_transfer`), so a decode worker whose prompts all
arrived over NIXL computes only the one token vLLM recomputes per request.

Step costs (the path choice's and the planner's measures, step_costs.py) come from the same
records: vLLM's engine core runs in a process of its own and says nothing of its step
times, so a step's seconds are the time between two iteration records while the engine
had requests running (an idle gap is no step), its prompt tokens those it computed, its
decode rows the tokens it generated less the first tokens (each ends a prefill).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from services.worker.step_costs import StepTimer


@dataclass(slots=True)
class VllmCounters:
    num_running: int = 0
    num_waiting: int = 0
    usage: float = 0.0  # of the KV cache, 0..1
    prompt_tokens: int = 0  # since start: prompt tokens scheduled
    prompt_tokens_computed: int = 0  # of those, computed here
    prompt_tokens_transferred: int = 0  # of those, pulled from a peer (NIXL)
    num_preemptions: int = 0
    timer: StepTimer = field(default_factory=StepTimer)  # step costs, from the records
    last_record_at: float | None = None  # the last iteration record's time
    running_since_last: bool = False  # requests were running when it came

    @property
    def prompt_tokens_not_computed(self) -> int:
        return self.prompt_tokens - self.prompt_tokens_computed


class CounterLogger(StatLoggerBase):
    """Feeds one `VllmCounters`; made by vLLM through `factory`."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.counters = VllmCounters()

    @classmethod
    def factory(cls, counters: VllmCounters) -> Callable[[VllmConfig, int], CounterLogger]:
        def make(vllm_config: VllmConfig, engine_index: int = 0) -> CounterLogger:
            logger = cls(vllm_config, engine_index)
            logger.counters = counters
            return logger

        return make

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: object = None,
        engine_idx: int = 0,
    ) -> None:
        counters = self.counters
        if scheduler_stats is not None:
            counters.num_running = scheduler_stats.num_running_reqs
            counters.num_waiting = scheduler_stats.num_waiting_reqs
            counters.usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            prompt = iteration_stats.prompt_token_stats
            counters.prompt_tokens += prompt.total
            counters.prompt_tokens_computed += prompt.computed
            counters.prompt_tokens_transferred += prompt.external_kv_transfer
            counters.num_preemptions += iteration_stats.num_preempted_reqs
            _time_step(counters, iteration_stats)
        if scheduler_stats is not None:
            counters.running_since_last = scheduler_stats.num_running_reqs > 0

    def log_engine_initialized(self) -> None:
        """Nothing to say: the worker logs its own start."""


def _time_step(counters: VllmCounters, stats: IterationStats) -> None:
    """Feed the step timer the step this record ends (see the module's docstring)."""
    last, counters.last_record_at = counters.last_record_at, stats.iteration_timestamp
    seconds = stats.iteration_timestamp - last if last is not None else 0.0
    if counters.running_since_last and seconds > 0:
        first_tokens = len(stats.time_to_first_tokens_iter)
        decode_rows = max(0, stats.num_generation_tokens - first_tokens)
        counters.timer.observe(seconds, stats.prompt_token_stats.computed, decode_rows)
