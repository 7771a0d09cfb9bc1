"""TTFT per label after a run's table (loadtest/by_label.py): a multi-turn run's turns, in
the order they were sent; nothing for a run of one label."""

from __future__ import annotations

from loadtest.by_label import format_by_label, ttft_by_label
from loadtest.request import RequestRecord


def record(label: str, send: float, ttft: float, error: str = "") -> RequestRecord:
    chunks = [] if error else [send + ttft, send + ttft + 0.01]
    return RequestRecord(label, send, chunk_times=chunks, output_tokens=2, error=error)


def test_each_label_gets_its_own_ttft_in_the_order_first_sent():
    records = [
        record("multi-turn t2", 5.0, 0.3),
        record("multi-turn t1", 0.0, 1.0),
        record("multi-turn t1", 1.0, 3.0),
        record("multi-turn t2", 6.0, 0.5),
        record("multi-turn t2", 7.0, 9.0, error="timeout"),  # not counted
    ]
    stats = ttft_by_label(records)
    assert list(stats) == ["multi-turn t1", "multi-turn t2"]
    assert (stats["multi-turn t1"].count, stats["multi-turn t1"].median) == (2, 2000.0)
    assert (stats["multi-turn t2"].count, round(stats["multi-turn t2"].mean, 6)) == (2, 400.0)
    lines = format_by_label(records).splitlines()
    assert len(lines) == 3 and lines[1].startswith("multi-turn t1")
    assert lines[1].split()[-3:] == ["2000.0", "2000.0", "2980.0"]  # mean, p50, p99


def test_a_run_of_one_label_prints_nothing_more():
    assert format_by_label([record("random", 0.0, 1.0), record("random", 1.0, 2.0)]) == ""
