"""`splitserve bench lora` (loadtest/engine_bench/lora.py) on the tiny model: its random
adapters load, both runs complete, and it reports the ratio, the adapters' share of the
time and the swap-ins (one per adapter when there are slots for all)."""

from __future__ import annotations

import re

from loadtest.engine_bench.lora import LoraBenchConfig, run_lora_bench
from tests.conftest import write_tiny_model


def test_bench_lora_reports_the_ratio_the_share_and_the_swap_ins(tmp_path, capsys):
    model_dir = write_tiny_model(tmp_path / "model", seed=1)
    config = LoraBenchConfig(
        model_dir, concurrency=4, adapters=3, rank=8, input_len=8, output_len=4, max_loras=3
    )
    run_lora_bench(config)
    out = capsys.readouterr().out
    ratio = re.search(r"over 3 adapters +([\d.]+) output tok/s +\(([\d.]+)x the base\)", out)
    assert ratio is not None and float(ratio[1]) > 0 and float(ratio[2]) > 0, out
    share = re.search(r"adapter products: ([\d.]+)% of the adapter run's time", out)
    assert share is not None and 0 < float(share[1]) < 100, out
    assert "(3 swap-ins)" in out
