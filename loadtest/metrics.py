"""Aggregate request records into the figures of a run.

vLLM's definitions (`vllm bench serve`, DESIGN.md section 8), per request:
  TTFT = first chunk with non-empty choices − send;  E2EL = last such chunk − send;
  TPOT = (E2EL − TTFT) / (output_tokens − 1);  ITL = every gap between chunks (pooled).
Output tokens are the server's `usage.completion_tokens`. Goodput = requests per second
that meet every SLO given. Other tools name things differently; their variants are kept
under their own names:
  AIPerf: inter_token_latency = vLLM's TPOT formula; time_to_second_token = second chunk −
    first; output_token_throughput_per_user = 1 / inter_token_latency.
  guidellm: time_per_output_token = E2EL / output_tokens (first token included);
    inter_token_latency = vLLM's TPOT formula.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from loadtest.request import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True, frozen=True)
class Stats:
    """Milliseconds (or tok/s for throughputs per user); NaN-free: empty gives zeros."""

    mean: float
    median: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: list[float], scale: float = 1000.0) -> Stats:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, 0)
        arr = np.asarray(values) * scale
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(float(arr.mean()), float(p50), float(p90), float(p99), len(values))


@dataclass(slots=True)
class Summary:
    completed: int
    failed: int
    errors: dict[str, int]
    error_examples: dict[str, str]  # one message per kind of error
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests / s meeting every SLO; None without SLOs
    max_concurrency_seen: int
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    aiperf: dict[str, Stats] = field(default_factory=dict)
    guidellm: dict[str, Stats] = field(default_factory=dict)


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=500ms,tpot=50ms,e2el=2s` → seconds per metric."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}; choose from {SLO_METRICS}")
        if value.endswith("ms"):
            slo[name] = float(value[:-2]) / 1000
        elif value.endswith("s"):
            slo[name] = float(value[:-1])
        else:
            slo[name] = float(value) / 1000  # bare numbers are milliseconds, as in vLLM
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(values[name] <= limit for name, limit in slo.items())


def max_concurrency(records: list[RequestRecord]) -> int:
    events = sorted([(r.send, 1) for r in records] + [(r.end, -1) for r in records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def summarize(
    records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None
) -> Summary:
    ok = [r for r in records if r.ok]
    duration_s = max(duration_s, 1e-9)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo else None
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=dict(Counter(r.error for r in records if not r.ok)),
        error_examples={r.error: r.error_detail for r in reversed(records) if not r.ok},
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput=None if good is None else good / duration_s,
        max_concurrency_seen=max_concurrency(records),
        ttft=Stats.of([r.ttft for r in ok]),
        tpot=Stats.of(tpots),
        itl=Stats.of([gap for r in ok for gap in r.itls]),
        e2el=Stats.of([r.e2el for r in ok]),
        aiperf={
            "inter_token_latency": Stats.of(tpots),
            "time_to_second_token": Stats.of(
                [r.chunk_times[1] - r.chunk_times[0] for r in ok if len(r.chunk_times) > 1]
            ),
            "output_token_throughput_per_user": Stats.of([1 / t for t in tpots if t > 0], 1.0),
        },
        guidellm={
            "time_per_output_token": Stats.of(
                [r.e2el / r.output_tokens for r in ok if r.output_tokens]
            ),
            "inter_token_latency": Stats.of(tpots),
        },
    )
