"""On a GPU: the engine with device="cuda" (Triton attention) against the CPU engine on the
tiny random Llama. fp32 gives the CPU's greedy tokens and logits; bf16 follows them within
bf16 rounding; every tensor a step builds is on the GPU; KV exported from the GPU engine is
on the CPU and decodes on a CPU engine; the draft model and the sampler's processing run
there too."""

from __future__ import annotations

import pytest
import torch

from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from tests.conftest import write_tiny_model
from tests.engine_harness import LogitsRecorder, run_to_completion

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = {
    "one": [5],
    "short": [3, 4, 5, 6, 7],
    "mid": [(7 * i) % 250 + 3 for i in range(37)],
    "long": [(11 * i) % 250 + 3 for i in range(70)],
}
BF16_ATOL = 0.3  # logits are O(3); bf16 weights and KV move them by up to ~0.2 (measured)


def make_engine(model_dir, device: str, **overrides) -> LLMEngine:
    settings = {"num_kv_blocks": 64, "max_num_batched_tokens": 16, "max_num_seqs": 8}
    return LLMEngine(EngineConfig(model_dir=model_dir, device=device, **(settings | overrides)))


def run(engine: LLMEngine, params=GREEDY, prompts=PROMPTS) -> dict[str, list[int]]:
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params)
    return run_to_completion(engine)


def run_recorded(engine: LLMEngine):
    """Greedy tokens, and the logits row behind each, by (prompt, position)."""
    recorder = LogitsRecorder(engine)
    return run(engine), recorder.rows


def test_fp32_matches_the_cpu_engine(tiny_model_dir):
    cpu_tokens, cpu_logits = run_recorded(make_engine(tiny_model_dir, "cpu"))
    gpu_tokens, gpu_logits = run_recorded(make_engine(tiny_model_dir, "cuda"))
    assert gpu_tokens == cpu_tokens
    assert gpu_logits.keys() == cpu_logits.keys()
    for key, ours in gpu_logits.items():
        assert ours.device.type == "cuda"
        torch.testing.assert_close(ours.cpu(), cpu_logits[key], atol=1e-3, rtol=0)


def test_bf16_follows_the_fp32_cpu_engine(tiny_model_dir):
    cpu_tokens, cpu_logits = run_recorded(make_engine(tiny_model_dir, "cpu"))
    gpu_tokens, gpu_logits = run_recorded(make_engine(tiny_model_dir, "cuda", dtype="bfloat16"))
    for name, prompt in PROMPTS.items():
        ours, reference = gpu_tokens[name], cpu_tokens[name]
        same = next((i for i in range(len(reference)) if ours[i] != reference[i]), None)
        # Up to the first divergence both saw the same context: their logits agree.
        for i in range(len(reference) if same is None else same + 1):
            key = (tuple(prompt), len(prompt) + i)
            torch.testing.assert_close(
                gpu_logits[key].cpu(), cpu_logits[key], atol=BF16_ATOL, rtol=0
            )
        if same is not None:  # only where fp32's two best tokens are within bf16 noise
            best = cpu_logits[(tuple(prompt), len(prompt) + same)].topk(2).values
            assert best[0] - best[1] < 2 * BF16_ATOL, (name, same)


def test_every_step_tensor_is_on_the_gpu(tiny_model_dir):
    engine = make_engine(tiny_model_dir, "cuda")
    runner = engine.runner
    weights = runner.model.weights
    assert weights.embed.is_cuda and weights.lm_head.is_cuda
    assert all(t.is_cuda for layer in weights.layers for t in (layer.qkv, layer.down))
    assert all(layer.is_cuda for layer in runner.kv_cache.layers)
    forward, seen = runner.model.forward, []

    def checked(input_ids, positions, meta: AttentionMetadata, kv_cache, logits_rows):
        tensors = [input_ids, positions, logits_rows, meta.slot_mapping]
        tensors += [meta.decode_block_tables, *(c.block_table for c in meta.prefills)]
        tensors += [] if meta.decode_mask is None else [meta.decode_mask]
        seen.append([t.device.type for t in tensors])
        return forward(input_ids, positions, meta, kv_cache, logits_rows)

    runner.model.forward = checked
    run(engine)
    assert seen and all(device == "cuda" for step in seen for device in step)


def test_kv_exported_from_the_gpu_decodes_on_a_cpu_engine(tiny_model_dir):
    prompt = PROMPTS["long"]
    expected = run(make_engine(tiny_model_dir, "cpu"), prompts={"r": prompt})["r"]
    prefill, decode = make_engine(tiny_model_dir, "cuda"), make_engine(tiny_model_dir, "cpu")
    prefill.add_request("r", prompt, GREEDY, hold_kv=True)
    first = run_to_completion(prefill)["r"]
    decode.reserve("r", prompt, GREEDY)
    blocks = prefill.export_kv("r")
    assert blocks.data.device.type == "cpu"  # what the KV transfer ships
    decode.import_kv("r", blocks)
    prefill.release("r")
    decode.start_decode("r", first[0])
    assert first + run_to_completion(decode)["r"] == expected


def test_draft_model_speculation_on_the_gpu_keeps_greedy_tokens(tmp_path, tiny_model_dir):
    draft_dir = write_tiny_model(tmp_path / "draft", seed=3, num_hidden_layers=1)
    plain = run(make_engine(tiny_model_dir, "cuda"))
    engine = make_engine(tiny_model_dir, "cuda", speculative="draft", draft_model_dir=draft_dir)
    assert run(engine) == plain
    assert engine.spec_stats.verify_steps > 0
    assert all(layer.is_cuda for layer in engine.proposer.runner.kv_cache.layers)


def test_sampling_with_processing_matches_the_cpu_engine(tiny_model_dir):
    params = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        logit_bias={7: 2.0},
        seed=11,
        max_tokens=12,
        ignore_eos=True,
        logprobs=3,
    )
    cpu = run(make_engine(tiny_model_dir, "cpu"), params)
    gpu = run(make_engine(tiny_model_dir, "cuda"), params)
    # The seeded draw is a pure function of (seed, position): fp32 logits this close give
    # the same tokens unless a draw lands within ~1e-6 of a boundary.
    assert gpu == cpu
