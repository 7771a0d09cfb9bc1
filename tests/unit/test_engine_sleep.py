"""An idle engine sleeps and wakes up (shared/engine/sleep_mode.py): level 1 gives back the
KV pool's pages (the prefix cache forgotten, each block reported removed), level 2 the
weights too; after waking up, a seeded request streams exactly what it did before."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import EngineError
from shared.engine.sampling_params import SamplingParams
from tests.engine_harness import run_to_completion

PROMPT = [(5 * i) % 200 + 3 for i in range(40)]
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)


def engine_of(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=32))


def generate(engine: LLMEngine, request_id: str) -> list[int]:
    engine.add_request(request_id, PROMPT, SEEDED)
    return run_to_completion(engine)[request_id]


@pytest.mark.parametrize("level", [1, 2])
def test_a_slept_engine_wakes_up_and_streams_what_it_did(tiny_model_dir, level):
    engine = engine_of(tiny_model_dir)
    before = generate(engine, "before")
    engine.take_kv_events()
    cached = len(engine.block_manager.cached)
    assert cached > 0
    engine.sleep(level)
    assert engine.take_kv_events().removed and not engine.block_manager.cached
    assert all(not layer.any() for layer in engine.runner.kv_cache.layers)  # pages given back
    assert engine.runner.has_weights == (level == 1)
    engine.wake_up()
    assert engine.runner.has_weights
    assert generate(engine, "after") == before  # computed again: nothing was cached


def test_an_engine_holding_a_request_does_not_sleep(tiny_model_dir):
    engine = engine_of(tiny_model_dir)
    engine.add_request("running", PROMPT, SEEDED)
    engine.step()
    with pytest.raises(EngineError, match="KV blocks in use"):
        engine.sleep(1)
    assert engine.runner.has_weights
    run_to_completion(engine)
    with pytest.raises(EngineError, match="sleep level 3"):
        engine.sleep(3)
