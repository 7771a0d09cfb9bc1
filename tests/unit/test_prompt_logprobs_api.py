"""Prompt logprobs from the engine on a tiny random Llama: each prompt token scored under
transformers' logits of the position before it, whatever the chunking, with prefix
caching on (a request that scores takes no cache hits), alongside plain requests."""

from __future__ import annotations

import torch

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from tests.engine_harness import hf_logits

PROMPT = [(7 * i) % 250 + 3 for i in range(37)]
SCORED = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)


def outputs_of(engine: LLMEngine) -> dict:
    found: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            found.setdefault(out.request_id, []).append(out)
    return found


def test_prompt_tokens_are_scored_as_transformers_scores_them(tiny_model_dir) -> None:
    logprobs = torch.log_softmax(hf_logits(tiny_model_dir, PROMPT), dim=-1)  # [P, V]
    for budget in (64, 16, 5):  # one chunk, several, many
        config = EngineConfig(model_dir=tiny_model_dir, dtype="float32", num_kv_blocks=64,
                              max_num_batched_tokens=budget, max_num_seqs=4)  # fmt: skip
        engine = LLMEngine(config)
        engine.add_request("warm", PROMPT, SamplingParams(temperature=0.0, max_tokens=2))
        outputs_of(engine)  # the prompt's blocks are now in the prefix cache
        engine.add_request("scored", PROMPT, SCORED)
        engine.add_request("plain", PROMPT[:20], SamplingParams(temperature=0.0, max_tokens=3))
        found = outputs_of(engine)
        first, *rest = found["scored"]
        assert all(out.prompt_logprobs is None for out in rest + found["plain"])
        scored = first.prompt_logprobs
        assert [e.token_id for e in scored] == PROMPT[1:], budget
        assert first.num_cached_tokens == 0  # no prefix-cache hit for a scoring request
        for q, entry in enumerate(scored):
            row = logprobs[q]
            assert abs(entry.logprob - row[PROMPT[q + 1]].item()) < 1e-4
            assert entry.rank == int((row > row[PROMPT[q + 1]]).sum()) + 1
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


def test_plain_requests_still_hit_the_prefix_cache(tiny_model_dir) -> None:
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=64, max_num_seqs=4))  # fmt: skip
    for name in ("a", "b"):
        engine.add_request(name, PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
        found = outputs_of(engine)
    assert found["b"][0].num_cached_tokens > 0 and found["b"][0].prompt_logprobs is None


def test_preempted_requests_send_their_prompt_logprobs_once(tiny_model_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    prompts = {f"r{i}": [(5 * i + 11 * j) % 250 + 3 for j in range(30)] for i in range(4)}
    config = EngineConfig(model_dir=tiny_model_dir, dtype="float32", num_kv_blocks=14,
                          max_num_batched_tokens=64, max_num_seqs=8,
                          enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(config)
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params)
    found = outputs_of(engine)
    assert engine.stats().num_preemptions > 0, "the cache was meant to be too small"
    for name, prompt in prompts.items():
        sent = [out.prompt_logprobs for out in found[name] if out.prompt_logprobs is not None]
        assert len(sent) == 1 and [e.token_id for e in sent[0]] == prompt[1:]
        assert found[name][0].prompt_logprobs is sent[0]
