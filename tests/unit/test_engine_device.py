"""EngineConfig.device: what auto picks, the clear error (when the engine's config resolves:
shared/engine/resolve.py) when CUDA is asked for but absent,
what a CUDA device implies for attention and batch invariance (with torch told it has
GPUs), the worker's --device flag, and `bench gpu` without a GPU. (In unit tests an
EngineConfig's auto is the CPU, tests/unit/conftest.py; auto itself is resolve_device's.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from services import cli
from services.worker import cli as worker_cli
from shared.engine import batch_invariant
from shared.engine.attention import resolve_backend
from shared.engine.engine_config import EngineConfig, resolve_device
from shared.engine.model_config import cpu_runs_bf16
from shared.engine.resolve import resolve

MODEL = Path("/models/m")  # never read: with a named dtype (auto on a GPU reads config.json)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """torch believes in two CUDA devices, the current one being cuda:1 (nothing runs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.usefixtures("no_cuda")
def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused_clearly():
    assert resolve_device("auto") == torch.device("cpu")
    assert EngineConfig(model_dir=MODEL, device="cpu").torch_device == torch.device("cpu")
    for name in ("cuda", "cuda:0"):
        config = EngineConfig(model_dir=MODEL, device=name)  # pure: nothing probed yet
        with pytest.raises(ValueError, match=f"device '{name}' asked for, but torch sees no CUDA"):
            resolve(config)


@pytest.mark.parametrize("name", ["gpu", "mps", "meta", ""])
def test_unknown_devices_are_refused(name):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig(model_dir=MODEL, device=name)


@pytest.mark.usefixtures("two_gpus")
def test_cuda_resolves_to_a_named_device_that_exists():
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert EngineConfig(model_dir=MODEL).torch_device == torch.device("cpu")  # unit tests' auto
    for device, index in (("cuda", 1), ("cuda:0", 0)):
        config = EngineConfig(model_dir=MODEL, dtype="float32", device=device)
        assert config.torch_device == torch.device("cuda", index)
    with pytest.raises(ValueError, match="torch sees 2 CUDA device"):
        resolve(EngineConfig(model_dir=MODEL, dtype="float32", device="cuda:2"))


@pytest.mark.usefixtures("two_gpus")
def test_on_cuda_attention_is_triton_and_batch_invariance_is_off():
    config = EngineConfig(model_dir=MODEL, dtype="float32", device="cuda")
    assert resolve_backend(config.attention_backend, config.torch_device) == "triton"
    assert batch_invariant.resolve(config) is False
    assert resolve_backend("auto", torch.device("cpu")) in ("cpu", "torch")
    for cpu_only in ({"attention_backend": "cpu"}, {"quantization": "int8"}):
        with pytest.raises(ValueError, match="not with device cuda"):
            EngineConfig(model_dir=MODEL, dtype="float32", device="cuda", **cpu_only)
    with pytest.raises(ValueError, match="not with device cuda"):
        EngineConfig(model_dir=MODEL, dtype="float32", device="cuda", batch_invariant=True)


def test_the_worker_device_and_dtype_flags_reach_the_engine_config():
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    flags = ["--dtype", "bfloat16", "--device", "cpu"]
    args = parser.parse_args(["--role", "both", "--model-dir", "/m", *flags])
    engine = worker_cli.config_from_args(args).engine_config()
    assert (engine.torch_device, engine.torch_dtype) == (torch.device("cpu"), torch.bfloat16)
    assert worker_cli.engine_argv(args) == tuple(flags)  # what `up` forwards to each worker
    default = worker_cli.config_from_args(parser.parse_args(["--model-dir", "/m"]))
    auto = "bfloat16" if cpu_runs_bf16() else "float32"  # --dtype auto, on this CPU
    assert (default.engine.device, resolve(default.engine).dtype) == ("auto", auto)


@pytest.mark.usefixtures("no_cuda")
def test_bench_gpu_fails_cleanly_without_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device"):
        cli.main(["bench", "gpu", "--weights-dir", str(tmp_path / "w")])
    assert not (tmp_path / "w").exists()  # nothing written before the check
