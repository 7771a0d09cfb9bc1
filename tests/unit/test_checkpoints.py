"""Checkpoints as they come: sharded bf16 safetensors loaded into fp32, and a clear refusal
of an architecture the engine does not serve."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.model_config import UnsupportedArchitecture, auto_dtype
from shared.engine.resolve import resolve
from shared.engine.sampling_params import SamplingParams
from tests.conftest import write_tiny_model
from tests.engine_harness import LogitsRecorder, hf_greedy, hf_logits, run_to_completion
from tests.hf_tiny_models import write_hf_model


@pytest.mark.slow
def test_sharded_bf16_checkpoint_loads_into_fp32(tmp_path):
    model_dir = write_hf_model(
        tmp_path / "m", "qwen3-moe", dtype=torch.bfloat16, max_shard_size="100KB"
    )
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir, dtype="float32", num_kv_blocks=32, attention_backend="torch"
        )
    )
    assert engine.runner.model.weights.embed.dtype == torch.float32
    recorder = LogitsRecorder(engine)
    prompt = [(3 * i) % 250 + 3 for i in range(21)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens = run_to_completion(engine)["r"]
    assert tokens == hf_greedy(model_dir, prompt, params.max_tokens)
    reference = hf_logits(model_dir, prompt + tokens)  # transformers: bf16 file, fp32 model
    for position in range(len(prompt), len(prompt) + len(tokens)):
        error = (recorder.rows[(tuple(prompt), position)] - reference[position - 1]).abs().max()
        assert error <= 1e-4, (position, error)


def test_an_architecture_we_do_not_serve_is_refused_by_name(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", architectures=["MambaForCausalLM"])
    with pytest.raises(UnsupportedArchitecture) as refused:
        LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=8))
    message = str(refused.value)
    assert "MambaForCausalLM is not served" in message
    assert "Qwen3MoeForCausalLM" in message and "Gemma3ForCausalLM" in message
    assert "--engine vllm" in message


def test_a_missing_shard_is_named(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=8))


@pytest.mark.parametrize(
    ("stored", "device", "bf16_ok", "expected"),
    [
        ("bfloat16", "cuda", True, "bfloat16"),
        ("bfloat16", "cuda", False, "float16"),
        ("float16", "cuda", True, "float16"),
        ("float32", "cuda", True, "float32"),
    ],
)
def test_dtype_auto_is_the_checkpoints_where_the_device_runs_it(
    tmp_path, monkeypatch, stored, device, bf16_ok, expected
):
    model_dir = write_tiny_model(tmp_path / "m", torch_dtype=stored)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16_ok)
    assert auto_dtype(model_dir, device) == expected


@pytest.mark.parametrize("bf16_kernels", [True, False])
def test_dtype_auto_on_a_cpu_is_bf16_where_the_kernels_multiply_it(
    tmp_path, monkeypatch, bf16_kernels
):
    import shared.engine.model_config as model_config

    monkeypatch.setattr(model_config, "cpu_runs_bf16", lambda kernel_matmuls=True: bf16_kernels)
    for stored in ("bfloat16", "float32"):
        model_dir = write_tiny_model(tmp_path / stored, torch_dtype=stored)
        assert auto_dtype(model_dir, "cpu") == ("bfloat16" if bf16_kernels else "float32")


class FakeKernels:
    """What cpu_runs_bf16 asks of the built kernels: their ISA, and bf16 dot products."""

    def __init__(self, features: list[str]) -> None:
        self.features = features

    def cpu_features(self) -> list[str]:
        return self.features

    def bf16_dot_product_kernel(self) -> bool:
        return "avx512_bf16" in self.features


@pytest.mark.parametrize(
    ("features", "kernel_matmuls", "expected"),
    [
        (["avx2", "avx512f", "avx512_bf16"], True, True),
        (["avx2", "avx512f", "avx512_bf16"], False, True),  # torch's bf16 is fast there too
        (["avx2", "avx512f"], True, True),  # the FMA chain widens bf16 weights
        (["avx2"], True, True),
        (["avx2"], False, False),  # torch's bf16 matmul without AVX512-BF16: 40x slower
        ([], True, False),  # the portable fallback
        (None, True, False),  # kernels not built
    ],
)
def test_bf16_runs_at_full_speed_on_a_cpu_only_where_a_vector_path_multiplies_it(
    monkeypatch, features, kernel_matmuls, expected
):
    from shared.engine import native
    from shared.engine.model_config import cpu_runs_bf16

    monkeypatch.setattr(native, "load", lambda: None if features is None else FakeKernels(features))
    assert cpu_runs_bf16(kernel_matmuls) is expected


def test_dtype_auto_on_an_avx2_cpu_is_float32_where_torch_runs_the_matmuls(tmp_path, monkeypatch):
    from shared.engine import native

    monkeypatch.setattr(native, "load", lambda: FakeKernels(["avx2"]))
    model_dir = write_tiny_model(tmp_path / "m", torch_dtype="bfloat16")

    def dtype(**settings) -> str:
        return resolve(EngineConfig(model_dir=model_dir, device="cpu", **settings)).dtype

    assert dtype() == "bfloat16"  # the C++ kernels (cpu attention, batch-invariant)
    assert dtype(batch_invariant=True) == "bfloat16"
    assert dtype(attention_backend="torch") == "float32"
    assert dtype(batch_invariant=False) == "float32"
    assert dtype(quantization="int8") == "float32"
    assert dtype(attention_backend="torch", dtype="bfloat16") == "bfloat16"  # named: kept


def test_engine_config_resolves_dtype_auto_once(tmp_path):
    from shared.engine.model_config import cpu_runs_bf16

    model_dir = write_tiny_model(tmp_path / "m", torch_dtype="bfloat16")
    expected = "bfloat16" if cpu_runs_bf16() else "float32"
    config = EngineConfig(model_dir=model_dir, dtype="auto", device="cpu")
    assert (config.dtype, resolve(config).dtype) == ("auto", expected)


def test_up_refuses_an_unserved_architecture_before_starting_anything(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", architectures=["MambaForCausalLM"])
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--model-dir", str(model_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "splitserve up:" in done.stderr and "MambaForCausalLM is not served" in done.stderr
    assert "Traceback" not in done.stderr
