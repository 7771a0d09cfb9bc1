"""The tier A/B bench's step clocks (loadtest/engine_bench/tier_ab.py): each step is sorted
by its shape (decode only, prompt and decode rows mixed, prompt only) and its time outside
the model's forward pass is summed, so the bench can show what a tier adds to a step."""

from __future__ import annotations

import pytest

from loadtest.engine_bench.tier_ab import Run, _clock_step, _ratio
from shared.engine.outputs import StepOutput


def step(prompt_tokens: int, decode_rows: int) -> StepOutput:
    return StepOutput(num_prompt_tokens=prompt_tokens, num_decode_rows=decode_rows)


def test_steps_are_sorted_by_shape_and_host_time_summed() -> None:
    run = Run("no-reuse", "on")
    _clock_step(run, 0.020, 0.018, step(0, 2))
    _clock_step(run, 0.300, 0.290, step(512, 1))
    _clock_step(run, 0.250, 0.245, step(512, 0))
    _clock_step(run, 0.022, 0.019, step(0, 2))
    assert run.decode_steps == [0.020, 0.022]
    assert run.mixed_steps == [0.300]
    assert run.steps == 4
    assert run.host_seconds == pytest.approx(0.002 + 0.010 + 0.005 + 0.003)
    line = run.step_line()
    assert "decode 21.0 ms (2)" in line
    assert "mixed 300.0 ms (1)" in line
    assert "host 5.000 ms a step" in line


def test_ratio_of_medians_and_missing_steps() -> None:
    assert _ratio([0.03, 0.01, 0.02], [0.01, 0.02]) == "1.33x"
    assert _ratio([], [0.01]) == "-"
    assert Run("no-reuse", "off").step_line().startswith("    steps: decode - ms (0)")
