"""Weight-only quantization and n-gram speculative decoding on the real default model."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from loadtest.engine_bench.quant import TEXT, encode_chat, perplexity
from loadtest.engine_bench.spec import TASKS
from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=128, **overrides))


def _generate(engine: LLMEngine, prompt: list[int], params=GREEDY) -> list[int]:
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    assert engine.block_manager.num_free_blocks == 128
    return tokens


@pytest.fixture(scope="module")
def text_tokens(real_model_dir) -> list[int]:
    tokenizer = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    return tokenizer.encode(TEXT.read_text(), add_special_tokens=False).ids[:1024]


@pytest.fixture(scope="module")
def fp32_perplexity(real_model_dir, text_tokens) -> float:
    return perplexity(_engine(real_model_dir, dtype="float32"), text_tokens, 512)


VNNI = native.load() is not None and native.load().int8_dot_product_kernel()
# w8a8 also rounds every activation row to 8 bits: measured 1.11x fp32's perplexity here. One
# token's log-probability is no measure of it: SmolLM2's outlier channels make a row's step
# coarse, so a 1e-6 change in a norm's output (fused native norm against torch's) flips
# roundings and moved "The" below from -1.78 to -0.66. Perplexity and the top-3 are checked.
W8A8 = pytest.param("w8a8", 1.15, None, marks=pytest.mark.skipif(not VNNI, reason="no AVX512-VNNI"))


@pytest.mark.parametrize(
    ("quantization", "bound", "logprob_bound"), [("int8", 1.03, 0.5), ("int4", 1.05, 0.5), W8A8]
)
def test_quantized_perplexity_stays_close_and_answers_right(
    real_model_dir,
    text_tokens,
    fp32_perplexity,
    quantization: str,
    bound: float,
    logprob_bound: float | None,
) -> None:
    engine = _engine(real_model_dir, quantization=quantization)
    ppl = perplexity(engine, text_tokens, 512)
    assert fp32_perplexity < 40 and ppl < fp32_perplexity * bound, (fp32_perplexity, ppl)
    # "What is the capital of France?" starts with a near-tie in fp32 ("The" -1.88, "L" -1.96)
    # that int4 flips; the check is that the answer's first-token distribution stays close.
    [prompt] = encode_chat(real_model_dir, ["What is the capital of France?"])
    fp32_top = _first_top(_engine(real_model_dir, dtype="float32"), prompt)
    top = _first_top(engine, prompt)
    assert fp32_top[0][0] in [token for token, _ in top]
    if logprob_bound is not None:
        assert abs(dict(top)[fp32_top[0][0]] - fp32_top[0][1]) < logprob_bound


def _first_top(engine: LLMEngine, prompt: list[int]) -> list[tuple[int, float]]:
    engine.add_request("top", prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))
    [out] = engine.step()
    return out.new_logprobs[0].top


def test_ngram_speculation_is_greedy_identical_and_accepts_copies(real_model_dir) -> None:
    prompts = encode_chat(real_model_dir, TASKS[2:4])
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = _engine(real_model_dir)
    spec = _engine(real_model_dir, speculative="ngram", num_speculative_tokens=4)
    for prompt in prompts:
        assert _generate(spec, prompt, params) == _generate(plain, prompt, params)
    assert spec.spec_stats.acceptance_rate > 0.3
