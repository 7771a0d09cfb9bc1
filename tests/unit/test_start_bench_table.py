"""`bench start`'s report (loadtest/start_bench.py): every phase a column, `weights_mapped`
among them, the wake-up's two timings where the engine slept (`-` where it did not), a
decode step's time where timed, and vLLM's compile (compiled or loaded, its engine init) per
worker where it compiled, and where the second worker came from (up's standby, or a fresh
process)."""

from __future__ import annotations

from loadtest.start_bench import StartRow, describe, table
from loadtest.vllm_compile_log import CompileCache, VllmCompile


def test_the_table_has_the_mapped_phase_and_the_wake_up_columns():
    slept = StartRow("native", "warm", 12.0, 10.5, {"imports": 8.0, "weights_mapped": 0.02})
    slept.token_s, slept.wake_s = 0.3, 0.45
    slept.second_ready_s, slept.second_from = 4.2, "standby"
    vllm = StartRow("vllm", "warm", 90.0, 80.0, {"imports": 20.0, "engine_rest": 60.0})
    vllm.step_s = 0.0421
    vllm.compile = VllmCompile(CompileCache.LOADED, 30.5, 4.0)
    vllm.second_compile = VllmCompile(CompileCache.LOAD_FAILED, 110.0, 20.0)
    head, _, native_row, vllm_row = table([slept, vllm]).splitlines()
    columns = head.split(" | ")
    cells = dict(zip(columns, native_row.split(" | "), strict=True))
    assert (cells["weights_mapped"], cells["weights_load"]) == ("0.02", "-")
    assert (cells["token_s"], cells["wake_s"]) == ("0.30", "0.45")
    others = dict(zip(columns, vllm_row.split(" | "), strict=True))
    assert (others["token_s"], others["wake_s"], others["engine_rest"]) == ("-", "-", "60.00")
    assert (others["step_ms"], cells["step_ms"]) == ("42.1", "-")
    assert (others["vllm_compile"], others["vllm_init_s"]) == ("loaded", "30.5")
    assert (others["second_vllm_compile"], others["second_vllm_init_s"]) == ("load_failed", "110.0")
    assert (cells["vllm_compile"], cells["second_vllm_init_s"]) == ("-", "-")
    assert (cells["second_ready_s"], cells["second_from"]) == ("4.2", "standby")
    assert (others["second_ready_s"], others["second_from"]) == ("-", "-")
    assert "a second worker beside it (standby) ready in 4.2s: " in describe(slept)
    failed = "(vLLM failed to load the compiled model and compiled it again; its engine init "
    assert failed + "110.0s (warm-up run 20.0s))" in describe(vllm)
    assert "; a decode step 42.1 ms" in describe(vllm)
    assert "a token served 0.45s after /wake_up (awake, a token took 0.30s)" in describe(slept)
