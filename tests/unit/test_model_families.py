"""Every family the engine serves, as a tiny random checkpoint built by transformers:
logits within 1e-4 of transformers' (fp32) through chunked prefill, paged decode, prefix-cache
hits and a batch of mixed lengths, and greedy tokens equal to its generate()."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are defined

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from tests.engine_harness import LogitsRecorder, hf_greedy, hf_logits, run_to_completion
from tests.hf_tiny_models import FAMILIES, WINDOW, write_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = {  # mixed lengths, past the window; "again" shares "long"'s first 48 tokens
    "short": [3, 4, 5, 6, 7],
    "mid": [(7 * i) % 250 + 3 for i in range(2 * WINDOW + 3)],
    "long": [(11 * i) % 250 + 3 for i in range(56)],
}
AGAIN = PROMPTS["long"][:48] + [9, 8, 7]


def check_family(model_dir, **engine_overrides) -> None:
    settings = {"num_kv_blocks": 64, "max_num_batched_tokens": 16, "max_num_seqs": 8}
    settings["dtype"] = "float32"  # exact against transformers' fp32
    engine = LLMEngine(EngineConfig(model_dir=model_dir, **(settings | engine_overrides)))
    recorder = LogitsRecorder(engine)
    for name, prompt in PROMPTS.items():  # one batch: chunked prefills beside decodes
        engine.add_request(name, prompt, GREEDY)
    outputs = run_to_completion(engine)
    engine.add_request("again", AGAIN, GREEDY)  # its first three blocks come from the cache
    hits_before = engine.stats().prefix_hits
    outputs |= run_to_completion(engine)
    assert engine.stats().prefix_hits - hits_before == 48
    for name, prompt in [*PROMPTS.items(), ("again", AGAIN)]:
        assert outputs[name] == hf_greedy(model_dir, prompt, GREEDY.max_tokens), name
        full = prompt + outputs[name]
        reference = hf_logits(model_dir, full)
        for position in range(len(prompt), len(full)):
            ours = recorder.rows[(tuple(prompt), position)]
            error = (ours - reference[position - 1]).abs().max().item()
            assert error <= 1e-4, (name, position, error)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(tmp_path, family):
    check_family(write_hf_model(tmp_path / family, family), attention_backend="torch")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "backend"),
    [("gemma2", "cpu"), ("mistral-window", "cpu"), ("gemma2", "triton")],
)
def test_windowed_and_capped_attention_in_every_backend(tmp_path, family, backend):
    if backend == "triton" and os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("Triton's interpreter is off (a GPU run)")
    if backend == "cpu":
        pytest.importorskip("shared.engine.native").load() or pytest.skip("no C++ kernels")
    check_family(write_hf_model(tmp_path / family, family), attention_backend=backend)
