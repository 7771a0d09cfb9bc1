"""The default model as a plain `pull` leaves it: the GGUF's Q4_1 / Q8_0 matrices kept
quantized (not converted to float32), at most 1.3x the file's size; served with the exact
weights it answers as its float32 copy does, and by default (int8 activations, as llama.cpp
runs the file) its next-token distribution stays near that one (the same top 5, a small KL
divergence; the answer's first token is a near tie, which llama.cpp's answer flips too)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from services.offline import chat_prompt_ids, stream_chat
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.model.checkpoint import quantized_formats
from shared.engine.sampling_params import SamplingParams
from shared.models.pull import MARKER, pull_model
from shared.models.registry import DEFAULT_MODEL, KNOWN_MODELS
from tests.engine_harness import greedy_logits

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def kept_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pull_model(DEFAULT_MODEL, home=tmp_path_factory.mktemp("home"))


def test_a_plain_pull_keeps_the_files_quantization(kept_dir: Path, real_model_dir: Path) -> None:
    assert json.loads((kept_dir / MARKER).read_text())["keep_quant"] is True
    assert quantized_formats(kept_dir) == ["Q4_1", "Q8_0"]
    weights = sum(p.stat().st_size for p in kept_dir.glob("*.safetensors"))
    assert weights <= 1.3 * KNOWN_MODELS[DEFAULT_MODEL].size
    floats = sum(p.stat().st_size for p in real_model_dir.glob("*.safetensors"))
    assert floats > 4 * weights  # the float32 copy


def test_exact_weights_answer_as_the_float_copy(kept_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model_dir=kept_dir, kv_cache_gib=0.25, group_quant_activations="float")
    )
    params = SamplingParams(temperature=0.0, max_tokens=32)
    answer = "".join(stream_chat(kept_dir, "What is the capital of France?", params, engine))
    assert answer == "The capital of France is Paris."


def test_by_default_activations_are_int8_and_the_logits_stay_near(
    kept_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = Tokenizer.from_file(str(kept_dir / "tokenizer.json"))
    prompt = chat_prompt_ids(kept_dir, tokenizer, "What is the capital of France?")
    with caplog.at_level(logging.INFO):
        auto = greedy_logits(kept_dir, prompt, 1)
    assert "Q4_1, Q8_0 kept quantized: the group-quant kernel with int8 activations" in caplog.text
    exact = greedy_logits(kept_dir, prompt, 1, group_quant_activations="float")
    assert not torch.equal(auto, exact)
    assert set(auto[0].topk(5).indices.tolist()) == set(exact[0].topk(5).indices.tolist())
    p, q = torch.log_softmax(exact[0].double(), -1), torch.log_softmax(auto[0].double(), -1)
    kl = float((p.exp() * (p - q)).sum())
    assert kl < 0.1, kl  # measured 0.029 nats: the first token is a near tie it may flip
