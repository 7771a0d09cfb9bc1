"""The engine on AWQ, GPTQ and compressed-tensors checkpoints that our writer
(tests/wna16_writer.py) made from a tiny float model: the same logits as the float model of
exactly the weights they store, within the documented bound of the original float model's
(docs/quantized-checkpoints.md), the same bits beside other requests, and the start-up's
refusals and log."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.model.checkpoint import Checkpoint, quantized_formats
from shared.engine.model.group_quant import GroupQuantLinear
from shared.engine.quantization import takes_int8_activations
from shared.engine.sampling_params import SamplingParams
from shared.errors import ConfigError
from shared.models.wna16_config import FP8_FORMATS, QuantFormat
from tests.conftest import write_tiny_model
from tests.engine_harness import (
    LogitsRecorder,
    assert_same_bits_beside_others,
    greedy_logits,
    run_to_completion,
)
from tests.hf_tiny_models import write_hf_model
from tests.wna16_writer import Scheme, write_quantized

PROMPT = list(range(3, 30))
SCHEMES = {
    "awq-g128": Scheme(QuantFormat.AWQ, 4, 128, symmetric=False),
    "gptq4-g32-act-order": Scheme(QuantFormat.GPTQ, 4, 32, symmetric=False, act_order=True),
    "gptq8-channel-sym": Scheme(QuantFormat.GPTQ, 8, 0, symmetric=True),
    "ct4-g128-sym-act-order": Scheme(QuantFormat.COMPRESSED, 4, 128, True, act_order=True),
    "ct8-w8a8-channel-sym": Scheme(QuantFormat.INT8, 8, 0, symmetric=True),
    "ct-fp8-channel": Scheme(QuantFormat.FP8, 8, 0, symmetric=True),
    "ct-fp8-tensor": Scheme(QuantFormat.FP8, 8, 0, symmetric=True, strategy="tensor"),
    "ct-fp8-block": Scheme(QuantFormat.FP8, 8, 0, True, strategy="block", block=(48, 96)),
    "fp8-block": Scheme(QuantFormat.FP8_VLLM, 8, 0, symmetric=True, strategy="block"),
    "fp8-tensor": Scheme(QuantFormat.FP8_VLLM, 8, 0, symmetric=True, strategy="tensor"),
}
# docs/quantized-checkpoints.md: the stored weights against the float model's, relative L2
WEIGHT_BOUND = {"awq-g128": 0.12, "gptq4-g32-act-order": 0.1, "gptq8-channel-sym": 0.01}
WEIGHT_BOUND["ct4-g128-sym-act-order"] = 0.15
WEIGHT_BOUND["ct8-w8a8-channel-sym"] = 0.01
WEIGHT_BOUND |= {name: 0.04 for name, scheme in SCHEMES.items() if scheme.format in FP8_FORMATS}
# (FP8's 3 mantissa bits: ~2.5%)
# and the prompt's logits, where the tiny random model (which amplifies weight error ~20x)
# keeps them comparable: 8-bit integers only (FP8's 3 mantissa bits err ~2.5%)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("wna16")
    # K = 128 or 256 (whole groups of 128), N a multiple of 8 (AWQ packs along N)
    write_tiny_model(root / "float", hidden_size=128, intermediate_size=256, head_dim=32)
    for name, scheme in SCHEMES.items():
        write_quantized(root / "float", root / name, scheme, root / f"{name}-weights")
    return root


def _logits(model_dir, **config) -> torch.Tensor:
    return greedy_logits(model_dir, PROMPT, 5, **config)


def test_the_checkpoint_loads_its_matrices_quantized(root):
    ckpt = Checkpoint(root / "awq-g128", torch.float32, torch.device("cpu"))
    assert ckpt.quantized_formats == ["AWQ 4-bit g128"] == quantized_formats(root / "awq-g128")
    assert ckpt.has("model.layers.0.mlp.down_proj.weight")
    w = ckpt.take_linear("model.layers.0.mlp.down_proj.weight")
    assert isinstance(w, GroupQuantLinear) and w.shape == (128, 256)
    with pytest.raises(ValueError, match=r"up_proj.weight is stored quantized \(AWQ 4-bit"):
        ckpt.take("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("name", SCHEMES)
def test_logits_are_those_of_the_float_model_of_the_stored_weights(root, name):
    ours = _logits(root / name, dtype="float32")
    floats = _logits(root / f"{name}-weights", dtype="float32")
    torch.testing.assert_close(ours, floats, rtol=0, atol=1e-4)  # only the order of sums differs
    stored = load_file(str(root / f"{name}-weights" / "model.safetensors"))
    original = load_file(str(root / "float" / "model.safetensors"))
    quantized = [key for key in original if key.endswith("_proj.weight")]
    error = torch.stack([(stored[key] - original[key]).norm() for key in quantized]).norm()
    error /= torch.stack([original[key].norm() for key in quantized]).norm()
    assert float(error) < WEIGHT_BOUND[name], float(error)
    if SCHEMES[name].bits == 8 and SCHEMES[name].format not in FP8_FORMATS:
        first = _logits(root / "float", dtype="float32")[0]  # the prompt's: the same context
        assert float((ours[0] - first).norm() / first.norm()) < 0.2


@pytest.mark.skipif(native.load() is None, reason="batch invariance needs the C++ kernels")
@pytest.mark.parametrize("name", ["awq-g128", "gptq4-g32-act-order", "ct-fp8-channel", "fp8-block"])
def test_a_requests_logits_are_the_same_bits_beside_others(root, name):
    assert_same_bits_beside_others(root / name, PROMPT)


def test_another_quantization_is_refused_and_the_log_names_the_format(root, caplog):
    with pytest.raises(ConfigError, match=r"already quantized \(AWQ 4-bit g128\).*int8"):
        LLMEngine(EngineConfig(model_dir=root / "awq-g128", num_kv_blocks=32, quantization="int8"))
    with caplog.at_level(logging.INFO):
        LLMEngine(EngineConfig(model_dir=root / "gptq8-channel-sym", num_kv_blocks=32))
    assert "CPU matmuls: GPTQ 8-bit per-channel sym kept quantized: " in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        LLMEngine(EngineConfig(model_dir=root / "fp8-block", num_kv_blocks=32))
    assert "CPU matmuls: fp8 8-bit block128x128 sym kept quantized: " in caplog.text


def test_auto_activations_are_float_for_awq_gptq_and_compressed_tensors(root):
    for name in ("awq-g128", "gptq8-channel-sym", "ct8-w8a8-channel-sym"):
        formats = quantized_formats(root / name)
        assert formats and not takes_int8_activations(root / name, formats, "auto"), name
        assert takes_int8_activations(root / name, formats, "int8"), name


def test_a_checkpoint_missing_a_part_is_refused_at_load_by_name(root, tmp_path):
    src = root / "awq-g128"
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=r"AWQ 4-bit g128 model.layers.1.self_attn.o_proj.\*: "):
        LLMEngine(EngineConfig(model_dir=tmp_path, num_kv_blocks=32))


@pytest.mark.skipif(native.load() is None, reason="the int8 kernel needs the C++ kernels")
@pytest.mark.parametrize("name", ["gptq8-channel-sym", "ct8-w8a8-channel-sym"])
def test_int8_activations_keep_batch_invariance_and_stay_near_float_ones(root, caplog, name):
    def rows(prompts: list[list[int]]) -> dict:
        config = EngineConfig(
            model_dir=root / name, num_kv_blocks=64, dtype="float32", group_quant_activations="int8"
        )
        engine = LLMEngine(config)
        recorder = LogitsRecorder(engine)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        run_to_completion(engine)
        return {key: row for key, row in recorder.rows.items() if key[0] == tuple(PROMPT)}

    with caplog.at_level(logging.INFO):
        alone = rows([PROMPT])
    label = "c-t int 8-bit per-channel sym" if name.startswith("ct8") else "GPTQ 8-bit"
    assert f"CPU matmuls: {label}" in caplog.text
    assert "kept quantized: the group-quant kernel with int8 activations per block" in caplog.text
    beside = rows([list(range(40, 51)), PROMPT, [7, 8, 9]])
    assert alone.keys() == beside.keys() and len(alone) == 3
    assert all(torch.equal(alone[key], beside[key]) for key in alone)
    first = alone[min(alone)]
    exact = _logits(root / name, dtype="float32")[0]  # float activations, the same context
    assert float((first - exact).norm() / exact.norm()) < 0.1  # the tiny model amplifies ~20x


@pytest.mark.slow
@pytest.mark.parametrize("name", ["awq-g128", "gptq4-g32-act-order", "fp8-block"])
def test_moe_experts_stored_quantized_give_the_float_logits_of_their_weights(tmp_path, name):
    """A Qwen3-MoE whose experts (one tensor set per expert, as HF stores them) are quantized
    with the rest: read as the other matrices, the logits of the float model of exactly the
    stored weights."""
    hf_dir = write_hf_model(
        tmp_path / "hf", "qwen3-moe", hidden_size=128, intermediate_size=128,
        moe_intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    write_quantized(hf_dir, tmp_path / "q", SCHEMES[name], tmp_path / "weights")
    ckpt = Checkpoint(tmp_path / "q", torch.float32, torch.device("cpu"))
    expert = ckpt.take_linear("model.layers.0.mlp.experts.1.down_proj.weight")
    assert isinstance(expert, GroupQuantLinear)
    ours = _logits(tmp_path / "q", dtype="float32")
    floats = _logits(tmp_path / "weights", dtype="float32")
    torch.testing.assert_close(ours, floats, rtol=0, atol=5e-5)
