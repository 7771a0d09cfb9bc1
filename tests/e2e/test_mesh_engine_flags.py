"""Engine and worker flags through the whole mesh: `splitserve up --quantization int8
--speculative ngram --kv-transport nats` as processes (tiny random model, real tokenizer).
The workers load int8 weights, the decode worker speculates (its heartbeats count proposed
and accepted drafts), KV moves over NATS though NIXL may load (the forced fallback), and
greedy answers equal the engine's with the same settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tokenizers import Tokenizer

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from tests.e2e.test_mesh import Mesh, mesh_model_dir, start_mesh  # noqa: F401 (a fixture)
from tests.engine_harness import run_to_completion

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Repetitive prompts: prompt lookup finds n-grams to propose.
PROMPTS = [[100 + (i % 7) for i in range(60)], [500, 600, 700, 800] * 12 + [500, 600]]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def flagged_mesh(mesh_model_dir, tmp_path_factory) -> Iterator[Mesh]:  # noqa: F811
    flags = ["--quantization", "int8", "--speculative", "ngram", "--kv-transport", "nats"]
    yield from start_mesh(mesh_model_dir, tmp_path_factory.mktemp("flags"), flags)


def engine_tokens(model_dir, prompt: list[int]) -> list[int]:
    config = EngineConfig(
        model_dir=model_dir, num_kv_blocks=256, quantization="int8", speculative="ngram"
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("r", prompt, params)
    return run_to_completion(engine)["r"]


def test_quantized_speculative_mesh_answers_like_the_engine(flagged_mesh, mesh_model_dir):  # noqa: F811
    tokenizer = Tokenizer.from_file(str(mesh_model_dir / "tokenizer.json"))
    model = flagged_mesh.client.models.list().data[0].id
    for prompt in PROMPTS:
        reply = flagged_mesh.client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        expected = tokenizer.decode(engine_tokens(mesh_model_dir, prompt))
        assert reply.choices[0].text == expected
        assert reply.usage.completion_tokens == MAX_TOKENS
    beats = {b.role: b for b in flagged_mesh.next_heartbeats()}
    assert beats["decode"].spec_verify_steps > 0
    assert 0 < beats["decode"].spec_accepted_tokens <= beats["decode"].spec_proposed_tokens
    assert beats["prefill"].spec_proposed_tokens == 0  # prefill workers never speculate
    assert beats["decode"].kv_transports == ["nats"]
    assert [(p.transport, p.transfers) for p in beats["prefill"].kv_peers] == [("nats", 2)]
