"""`bench start`'s report (loadtest/start_bench.py): every phase a column, `weights_mapped`
among them, and the wake-up's two timings where the engine slept (`-` where it did not)."""

from __future__ import annotations

from loadtest.start_bench import StartRow, describe, table


def test_the_table_has_the_mapped_phase_and_the_wake_up_columns():
    slept = StartRow("native", "warm", 12.0, 10.5, {"imports": 8.0, "weights_mapped": 0.02})
    slept.token_s, slept.wake_s = 0.3, 0.45
    vllm = StartRow("vllm", "warm", 90.0, 80.0, {"imports": 20.0, "engine_rest": 60.0})
    head, _, native_row, vllm_row = table([slept, vllm]).splitlines()
    columns = head.split(" | ")
    cells = dict(zip(columns, native_row.split(" | "), strict=True))
    assert (cells["weights_mapped"], cells["weights_load"]) == ("0.02", "-")
    assert (cells["token_s"], cells["wake_s"]) == ("0.30", "0.45")
    others = dict(zip(columns, vllm_row.split(" | "), strict=True))
    assert (others["token_s"], others["wake_s"], others["engine_rest"]) == ("-", "-", "60.00")
    assert "a token served 0.45s after /wake_up (awake, a token took 0.30s)" in describe(slept)
