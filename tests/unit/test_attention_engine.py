"""The engine on each attention backend: logits match transformers through chunked
prefill, prefix-cache hits (prefill over a cached prefix) and batched decodes."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from tests.engine_harness import LogitsRecorder, hf_logits, run_to_completion

BACKENDS = [
    "torch",
    pytest.param(
        "cpu", marks=pytest.mark.skipif(native.load() is None, reason="C++ kernels not built")
    ),
]
PREFIX = [(13 * i) % 250 + 3 for i in range(40)]
PROMPTS = {
    "one": [5],
    "mid": [(7 * i) % 250 + 3 for i in range(37)],
    "shared-a": [*PREFIX, 9, 8, 7],
    "shared-b": [*PREFIX, 4, 5, 6, 7, 8],
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(tiny_model_dir, backend):
    engine = LLMEngine(
        EngineConfig(
            model_dir=tiny_model_dir,
            dtype="float32",  # exact against transformers' fp32
            attention_backend=backend,
            num_kv_blocks=64,
            max_num_batched_tokens=16,  # chunked prefill: later chunks see a cached context
            max_num_seqs=8,
        )
    )
    recorder = LogitsRecorder(engine)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = {name: PROMPTS[name] for name in ("one", "mid", "shared-a")}
    for name, prompt in first.items():
        engine.add_request(name, prompt, params)
    outputs = run_to_completion(engine)
    engine.add_request("shared-b", PROMPTS["shared-b"], params)  # hits shared-a's prefix
    outputs |= run_to_completion(engine)
    assert engine.scheduler.block_manager.prefix_hits > 0
    for name, prompt in PROMPTS.items():
        full = prompt + outputs[name]
        reference = hf_logits(tiny_model_dir, full)
        for position in range(len(prompt), len(full)):
            ours = recorder.rows[(tuple(prompt), position)]
            assert torch.allclose(ours, reference[position - 1], atol=1e-4), (name, position)
