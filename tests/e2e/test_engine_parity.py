"""The engine on the real default model in fp32 against transformers, the reference (bf16:
test_bf16_parity.py)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from services.offline import chat_prompt_ids
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from tests.engine_harness import LogitsRecorder, hf_greedy, hf_logits, run_to_completion

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
    "was the season of Light, it was the season of Darkness, it was the spring of hope, it was "
    "the winter of despair, we had everything before us, we had nothing before us. "
)
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def tokenizer(real_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))


def test_logits_match_transformers_through_chunked_prefill_and_paged_decode(
    real_model_dir, tokenizer
):
    ids = tokenizer.encode(TEXT * 6, add_special_tokens=False).ids
    prompts = {f"len{n}": ids[:n] for n in (5, 64, 171, 300)}
    engine = LLMEngine(
        EngineConfig(
            model_dir=real_model_dir, dtype="float32", max_num_batched_tokens=64, kv_cache_gib=0.25
        )
    )
    recorder = LogitsRecorder(engine)
    params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)  # 1 + 32 decodes
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params)
    outputs = run_to_completion(engine)
    for name, prompt in prompts.items():
        full = prompt + outputs[name]
        reference = hf_logits(real_model_dir, full)
        worst = max(
            (recorder.rows[(tuple(prompt), p)] - reference[p - 1]).abs().max().item()
            for p in range(len(prompt), len(full))
        )
        assert worst <= 1e-3, f"{name}: max |logit difference| {worst:.2e}"


def test_greedy_chat_answers_equal_transformers(real_model_dir, tokenizer):
    engine = LLMEngine(EngineConfig(model_dir=real_model_dir, dtype="float32", kv_cache_gib=0.25))
    params = SamplingParams(temperature=0.0, max_tokens=64)
    prompts = {
        f"chat{i}": chat_prompt_ids(real_model_dir, tokenizer, m) for i, m in enumerate(CHATS)
    }
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params)
    outputs = run_to_completion(engine)
    for name, prompt in prompts.items():
        assert outputs[name] == hf_greedy(real_model_dir, prompt, 64), name
    answer = tokenizer.decode(outputs["chat0"], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."
