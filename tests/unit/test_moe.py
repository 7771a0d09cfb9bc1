"""Routed experts (Mixtral, Qwen3-MoE): the per-expert kernel against a per-token loop on a
batch whose tokens pick different experts, and bit-for-bit batch invariance of a row on the
CPU (packed weights), in the kernel and through the engine."""

from __future__ import annotations

import pytest
import torch

from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.model.linear_weights import PackedLinear
from shared.engine.model.moe import route, routed_experts
from shared.engine.model.weights import ExpertWeights
from shared.engine.sampling_params import SamplingParams
from tests.engine_harness import LogitsRecorder, run_to_completion
from tests.hf_tiny_models import write_hf_model

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 6, 2
needs_kernels = pytest.mark.skipif(native.load() is None, reason="needs the C++ kernels")


def random_experts(seed: int = 0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    return ExpertWeights(
        router=rand(EXPERTS, HIDDEN) * 5,
        gate_up=[rand(2 * INTER, HIDDEN) for _ in range(EXPERTS)],
        down=[rand(HIDDEN, INTER) for _ in range(EXPERTS)],
    )


def per_token_reference(x, experts: ExpertWeights, renormalize: bool) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ experts.router.T, -1)
        weights, chosen = torch.topk(probs, TOP_K)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, chosen.tolist(), strict=True):
            fused = experts.gate_up[e] @ x[t]
            out[t] += w * (
                experts.down[e] @ (torch.nn.functional.silu(fused[:INTER]) * fused[INTER:])
            )
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_match_a_per_token_loop(renormalize):
    experts = random_experts()
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(1))
    _, chosen = route(x @ experts.router.T, TOP_K, renormalize)
    assert len(chosen.unique()) == EXPERTS  # the batch's tokens spread over every expert
    ours = routed_experts(x, experts, TOP_K, renormalize, "silu")
    assert torch.allclose(ours, per_token_reference(x, experts, renormalize), atol=1e-5)


@needs_kernels
def test_a_row_is_bit_identical_alone_and_in_any_batch():
    experts = random_experts().map(PackedLinear.pack)
    x = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(2))
    batch = routed_experts(x, experts, TOP_K, True, "silu")
    for t in range(x.shape[0]):
        alone = routed_experts(x[t : t + 1], experts, TOP_K, True, "silu")
        assert torch.equal(alone[0], batch[t]), t
    assert torch.equal(routed_experts(x[3:9], experts, TOP_K, True, "silu"), batch[3:9])


@needs_kernels
@pytest.mark.slow
def test_engine_logits_of_an_moe_model_do_not_depend_on_the_batch(tmp_path):
    model_dir = write_hf_model(tmp_path / "mixtral", "mixtral")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [(5 * i) % 250 + 3 for i in range(30)]
    others = {f"other{i}": [(13 * j + i) % 250 + 3 for j in range(9 + 7 * i)] for i in range(3)}

    def logits_of(batch: dict[str, list[int]]) -> list[torch.Tensor]:
        engine = LLMEngine(
            EngineConfig(
                model_dir=model_dir, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8,
                attention_backend="cpu", batch_invariant=True,
            )
        )  # fmt: skip
        recorder = LogitsRecorder(engine)
        for name, ids in batch.items():
            engine.add_request(name, ids, params)
        run_to_completion(engine)
        return [v for (ids, _), v in sorted(recorder.rows.items()) if list(ids) == prompt]

    alone = logits_of({"p": prompt})
    batched = logits_of({**others, "p": prompt})
    assert len(alone) == len(batched) == params.max_tokens
    assert all(torch.equal(a, b) for a, b in zip(alone, batched, strict=True))


def test_quantizing_an_moe_model_is_refused_before_loading(tmp_path):
    model_dir = write_hf_model(tmp_path / "mixtral", "mixtral")
    with pytest.raises(ValueError, match="not supported for MoE models"):
        LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=8, quantization="int8"))
