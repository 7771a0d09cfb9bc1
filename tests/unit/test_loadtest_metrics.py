"""The harness's figures from hand-built request records: vLLM's definitions exactly."""

from __future__ import annotations

import pytest

from loadtest.metrics import max_concurrency, parse_slo, summarize
from loadtest.request import RequestRecord


def record(send: float, chunks: list[float], tokens: int, end: float = 0.0) -> RequestRecord:
    return RequestRecord(
        "t", send, chunks, prompt_tokens=10, output_tokens=tokens, usage_reported=True,
        end=end or chunks[-1],
    )  # fmt: skip


def test_per_request_definitions() -> None:
    # first chunk at +0.2 s, then chunks (of several tokens) at +0.3, +0.5, +0.6
    r = record(1.0, [1.2, 1.3, 1.5, 1.6], tokens=7)
    assert r.ttft == pytest.approx(0.2)
    assert r.e2el == pytest.approx(0.6)
    assert r.tpot == pytest.approx((0.6 - 0.2) / 6)  # per token, from usage
    assert r.itls == pytest.approx([0.1, 0.2, 0.1])  # per chunk
    assert record(0.0, [0.5], tokens=1).tpot is None


def test_summary_matches_known_values() -> None:
    records = [
        record(0.0, [0.1, 0.2, 0.3], tokens=3),  # TTFT 100, TPOT 100, E2EL 300
        record(0.0, [0.3, 0.4, 0.5], tokens=3),  # TTFT 300, TPOT 100, E2EL 500
        RequestRecord("t", 0.5, error="http_429", end=0.6),
        RequestRecord("t", 0.5, error="timeout", end=1.0),
        RequestRecord("t", 0.5, error="timeout", end=1.0),
    ]
    s = summarize(records, duration_s=2.0, slo=parse_slo("ttft=200ms"))
    assert (s.completed, s.failed) == (2, 3)
    assert s.errors == {"http_429": 1, "timeout": 2}
    assert s.ttft.mean == pytest.approx(200) and s.ttft.median == pytest.approx(200)
    assert s.tpot.mean == pytest.approx(100)
    assert s.e2el.mean == pytest.approx(400)
    assert s.itl.count == 4 and s.itl.mean == pytest.approx(100)
    assert s.total_output_tokens == 6 and s.total_input_tokens == 20
    assert s.output_throughput == pytest.approx(3.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.goodput == pytest.approx(0.5)  # only the first meets TTFT ≤ 200 ms
    # the other tools' variants, under their own names
    assert s.aiperf["inter_token_latency"].mean == pytest.approx(100)
    assert s.aiperf["time_to_second_token"].mean == pytest.approx(100)
    assert s.aiperf["output_token_throughput_per_user"].mean == pytest.approx(10.0)
    assert s.guidellm["time_per_output_token"].mean == pytest.approx(400 / 3)


def test_percentiles() -> None:
    records = [record(0.0, [i / 1000, 1.0], tokens=2) for i in range(1, 101)]
    s = summarize(records, 1.0)
    assert s.ttft.median == pytest.approx(50.5)
    assert s.ttft.p90 == pytest.approx(90.1)
    assert s.ttft.p99 == pytest.approx(99.01)


def test_parse_slo_units() -> None:
    assert parse_slo("ttft=500ms,tpot=50,e2el=2s") == pytest.approx(
        {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    )
    with pytest.raises(ValueError, match="unknown SLO"):
        parse_slo("itl=5ms")


def test_max_concurrency() -> None:
    records = [record(0.0, [1.0], 1), record(0.5, [1.5], 1), record(1.2, [2.0], 1)]
    assert max_concurrency(records) == 2
