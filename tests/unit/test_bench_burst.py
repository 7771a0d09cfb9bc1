"""`splitserve bench burst` on the tiny model: every prompt of the burst gets its first token
within the steps the token budget implies, each thread count is timed, and the printed line
says so."""

from __future__ import annotations

from loadtest.engine_bench.burst import BurstBenchConfig, run_burst_bench


def test_a_burst_takes_the_steps_its_token_budget_implies(tiny_model_dir, capsys):
    config = BurstBenchConfig(
        tiny_model_dir, prompts=5, prompt_len=40, max_num_batched_tokens=64, threads=(1, 2),
        trials=1, dtype="float32",
    )  # fmt: skip
    timings = run_burst_bench(config)
    assert [t.threads for t in timings] == [1, 2]
    for timing in timings:
        assert len(timing.step_ms) == 4  # 200 prompt tokens, 64 a step
        assert timing.total_ms == sum(timing.step_ms) > 0
    out = capsys.readouterr().out
    assert out.count("5 x 40 tokens") == 2 and "2 thread(s): last first token after" in out
