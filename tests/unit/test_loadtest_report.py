"""The terminal table and the matrix table name every figure and every kind of error."""

from __future__ import annotations

from loadtest.matrix import format_matrix
from loadtest.metrics import Summary, summarize
from loadtest.report import format_table
from loadtest.request import RequestRecord


def summary() -> Summary:
    ok = RequestRecord("t", 0.0, [0.1, 0.2], 5, 2, True, end=0.2)
    busy = RequestRecord("t", 0.0, error="http_429", error_detail="queue full", end=0.1)
    return summarize([ok, busy], 1.0)


def test_table_lists_metrics_and_errors() -> None:
    table = format_table("run", summary())
    for needle in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "E2EL (ms)", "AIPerf variants",
                   "time_to_second_token", "guidellm variants", "time_per_output_token",
                   "errors: http_429", "http_429: queue full"):  # fmt: skip
        assert needle in table
    ttft_row = next(line for line in table.splitlines() if line.startswith("TTFT"))
    assert ttft_row.split()[2:] == ["100.00"] * 4  # mean, median, p90, p99


def test_matrix_rows_and_reference() -> None:
    table = format_matrix({"disaggregated c=1": summary()})
    assert "| disaggregated c=1 | 100.0 | 100.0 | 100.0 | 100.0 | 2.0 | 1 |" in table
    assert "llama-server F32 c=16" in table
