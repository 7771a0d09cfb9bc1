"""`splitserve bench lora` (loadtest/engine_bench/lora.py) on the tiny model: its random
adapters load, every round's three runs complete, and it reports the medians, the ratio,
where the adapter runs' time goes, the floor and the swap-ins (one per adapter when there are
slots for all); its clocks (lora_profile.py) see the products only on adapter rows, and come
off the engine when a run ends."""

from __future__ import annotations

import re

import pytest

from loadtest.engine_bench.lora import (
    LoraBenchConfig,
    run_lora_bench,
    timed_run,
    write_random_adapter,
)
from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.lora.stacked import StackedPair
from shared.engine.model_config import ModelConfig
from tests.conftest import write_tiny_model

needs_kernels = pytest.mark.skipif(native.load() is None, reason="C++ kernels not built")


def test_bench_lora_reports_the_rounds_the_ratio_the_profile_and_the_swap_ins(tmp_path, capsys):
    model_dir = write_tiny_model(tmp_path / "model", seed=1)
    config = LoraBenchConfig(
        model_dir, concurrency=4, adapters=3, rank=8, input_len=8, output_len=4, max_loras=3,
        rounds=2,
    )  # fmt: skip
    run_lora_bench(config)
    out = capsys.readouterr().out
    for i in (1, 2):
        assert re.search(rf"^ +{i} +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M), out
    ratio = re.search(r"over 3 adapters +([\d.]+) output tok/s +\(([\d.]+)x the base\)", out)
    assert ratio is not None and float(ratio[1]) > 0 and float(ratio[2]) > 0, out
    share = re.search(r"adapter products: ([\d.]+)% of the adapter run's time", out)
    assert share is not None and 0 < float(share[1]) < 100, out
    floor = re.search(r"floor: 3 adapters x [\d.]+ MB = \d+ MB a decode step", out)
    assert floor is not None, out
    assert "(3 swap-ins)" in out


def test_bench_lora_refuses_no_rounds(tmp_path):
    with pytest.raises(ValueError, match="rounds"):
        run_lora_bench(LoraBenchConfig(tmp_path, rounds=0))


@needs_kernels
def test_the_clocks_see_products_on_adapter_rows_only_and_come_off(tmp_path):
    model_dir = write_tiny_model(tmp_path / "model", seed=2)
    adapter = write_random_adapter(tmp_path / "a", ModelConfig.from_dir(model_dir), 4, seed=0)
    engine = LLMEngine(
        EngineConfig(model_dir=model_dir, lora_modules=(f"a={adapter}",), num_kv_blocks=64)
    )
    prompts = [[3 + i, 5, 7, 9, 11] for i in range(3)]
    base = timed_run(engine, prompts, [""] * 3, 4)
    lora = timed_run(engine, [[p + 1 for p in prompt] for prompt in prompts], ["a"] * 3, 4)
    assert base.tokens == lora.tokens == 12
    for clock in (base, lora):
        assert clock.decode_steps > 0 and clock.prompt_steps > 0
        assert 0 < clock.decode_s + clock.prompt_s < clock.seconds
        assert clock.begin_step_s > 0
    # No product for base rows: the bank returns at once, or (where a step without adapter
    # rows runs the plain engine's path, e.g. one native call per layer) is never asked.
    assert base.kernel_s == 0
    assert 0 < lora.kernel_decode_s < lora.kernel_s <= lora.add_products_s
    assert StackedPair.add.__name__ == "add"  # the class's own again
    assert "forward" not in vars(engine.runner)
    assert "add_products" not in vars(engine.adapters)
