"""A GGUF file converted keeping its quantization (the default), loaded and served as it is.

The tiny GGUF files of test_gguf_convert.py (Q8_0 q/k, permuted as llama.cpp does; Q4_0,
Q4_1, Q5_0, Q5_1 elsewhere) convert twice: kept and float32. The kept matrices load as the
float conversion's values exactly, the engine's logits on both agree to float rounding, and
against the file's float original (every tensor F32) they stay within the quantization's
documented bound (docs/quantized-checkpoints.md)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from safetensors.torch import save_file

from shared.engine import native, quantization
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.model.checkpoint import Checkpoint, quantized_formats
from shared.engine.model.group_quant import GroupQuantLinear
from shared.engine.quantization import takes_int8_activations
from shared.errors import ConfigError
from shared.models.gguf_convert import convert_gguf
from tests.engine_harness import (
    assert_same_bits_beside_others,
    greedy_logits,
)
from tests.unit import test_gguf_convert as tiny

PROMPT = list(range(3, 30))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(kept, float32) conversions of one quantized tiny GGUF, and of its all-F32 twin."""
    root = tmp_path_factory.mktemp("keep-quant")
    quantized = tiny.write_tiny_gguf(root / "q.gguf", arch="qwen2")
    convert_gguf(quantized.path, root / "kept", keep_quant=True)
    convert_gguf(quantized.path, root / "float", keep_quant=False)
    all_q8 = dict.fromkeys(tiny.STORED_AS, T.Q8_0) | {"token_embd.weight": T.Q8_0}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny, "STORED_AS", {})
        original = tiny.write_tiny_gguf(root / "f32.gguf", arch="qwen2")
        patch.setattr(tiny, "STORED_AS", all_q8)
        q8 = tiny.write_tiny_gguf(root / "q8.gguf", arch="qwen2")
    convert_gguf(original.path, root / "f32")
    convert_gguf(q8.path, root / "q8", keep_quant=True)
    return root


def test_kept_matrices_load_as_the_float_conversion(dirs):
    kept = Checkpoint(dirs / "kept", torch.float32, torch.device("cpu"))
    assert kept.quantized_formats == ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
    assert quantized_formats(dirs / "kept") == kept.quantized_formats
    assert quantized_formats(dirs / "float") == []
    with safe_open(str(dirs / "float" / "model.safetensors"), framework="pt") as ref:
        for name in sorted(kept.quantized):
            w = kept.take_linear(name)
            assert isinstance(w, GroupQuantLinear), name
            assert torch.equal(w.dequantize(), ref.get_tensor(name)), name


def test_a_kept_matrix_missing_a_part_is_refused_by_name(dirs, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"  # Q4_1: scales and mins
    with safe_open(str(dirs / "kept" / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != name + ".super_min"}  # noqa: SIM118
        metadata = f.metadata()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata=metadata)
    ckpt = Checkpoint(tmp_path, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"quantized tensor {name}: .*super_min"):
        ckpt.take_linear(name)
    with pytest.raises(ValueError, match=r"layers.0.self_attn.q_proj.weight is stored quantized"):
        ckpt.take("model.layers.0.self_attn.q_proj.weight")


def _logits(model_dir, **config) -> torch.Tensor:
    return greedy_logits(model_dir, PROMPT, 6, **config)


def test_the_engine_on_kept_weights_gives_the_float_conversions_logits(dirs):
    kept = _logits(dirs / "kept", dtype="float32", group_quant_activations="float")
    floats = _logits(dirs / "float", dtype="float32")
    assert kept.shape == floats.shape == (6, floats.shape[1])
    # the same weight values; only the order of the sums differs
    torch.testing.assert_close(kept, floats, rtol=0, atol=1e-5)


def test_q8_0_logits_stay_within_their_bound_of_the_float_model(dirs):
    q8, original = _logits(dirs / "q8"), _logits(dirs / "f32", dtype="float32")
    error = (q8 - original).norm() / original.norm()
    assert error < 0.02  # docs/quantized-checkpoints.md: Q8_0 within 2% (relative L2)


def test_a_quantized_checkpoint_refuses_another_quantization(dirs):
    with pytest.raises(ConfigError, match=r"already quantized .*Q4_0.*int8"):
        LLMEngine(EngineConfig(model_dir=dirs / "kept", num_kv_blocks=32, quantization="int8"))


@pytest.mark.skipif(native.load() is None, reason="batch invariance needs the C++ kernels")
def test_a_requests_logits_are_the_same_bits_beside_others(dirs):
    assert_same_bits_beside_others(dirs / "kept", PROMPT)


def test_auto_activations_are_int8_for_gguf_files_as_llama_cpp_runs_them(dirs):
    kept = quantized_formats(dirs / "kept")
    assert takes_int8_activations(dirs / "kept", kept, "auto")
    assert takes_int8_activations(dirs / "kept", kept, "int8")
    assert not takes_int8_activations(dirs / "kept", kept, "float")
    assert not takes_int8_activations(dirs / "float", [], "auto")  # nothing kept


@pytest.mark.skipif(native.load() is None, reason="the log names the C++ kernels' paths")
@pytest.mark.parametrize(
    ("panels", "words"),
    [
        ("amx", "AMX-INT8 tiles for Q4_0-Q8_0 and Q2_K-Q6_K, "),
        ("vnni", "AVX512-VNNI over 16-column panels for Q4_0-Q8_0 and Q2_K-Q6_K, "),
        (None, "int8 activations per block, "),
    ],
)
def test_the_start_up_log_names_the_panel_path(monkeypatch, panels, words):
    monkeypatch.setattr(quantization, "int8_panels", lambda: panels)
    text = quantization.describe_shipped(["Q4_1", "Q8_0"], int8_activations=True)
    assert text.startswith("Q4_1, Q8_0 kept quantized: ") and words in text
    assert ("panels" in text) == (panels == "vnni") and ("AMX" in text) == (panels == "amx")
