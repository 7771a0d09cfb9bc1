"""A vLLM worker's engine arguments and environment on a CPU: the model in the engine core
process (no third process spinning on a core), vLLM's own step budget unless one is given,
and the KV buffer on the device the worker resolved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("vllm", reason="vLLM is not installed here (make install ENGINE=vllm)")

from vllm.config.kv_events import KVEventsConfig

from services.worker.config import WorkerConfig
from services.worker.vllm_compile_cache import COMPILE_CACHE_ENV, without_ports
from services.worker.vllm_engine_args import engine_args, set_environment, vllm_engine_config
from services.worker.vllm_nixl_plugin import QUIET_NIXL_ENV
from shared.engine.engine_config import EngineConfig
from shared.errors import ConfigError
from shared.models.quant_metadata import QUANT_METADATA
from shared.models.wna16_config import QuantFormat
from tests.wna16_writer import Scheme

SET_BY_THE_WORKER = (
    QUIET_NIXL_ENV,
    COMPILE_CACHE_ENV,
    "VLLM_CACHE_ROOT",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "OMP_NUM_THREADS",
    "VLLM_CPU_OMP_THREADS_BIND",
)


def worker(**engine_fields) -> WorkerConfig:
    engine = EngineConfig(model_dir=Path("/m"), block_size=32, device="cpu", **engine_fields)
    return WorkerConfig(
        worker_id="p", role="prefill", model_name="m", engine_kind="vllm", engine=engine
    )


@pytest.fixture
def clean_environment(monkeypatch):
    """The variables a worker sets, unset now and put back as they were after the test."""
    for name in SET_BY_THE_WORKER:
        monkeypatch.delenv(name, raising=False)


def test_on_a_cpu_the_model_runs_in_the_engine_core_process(clean_environment):
    set_environment(worker())
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0


def test_openmp_threads_on_every_core_unbound_unless_told(clean_environment, monkeypatch):
    set_environment(worker())
    assert os.environ["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    set_environment(worker(num_threads=3))
    assert os.environ["OMP_NUM_THREADS"] == "3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the operator's own binding


def test_the_step_budget_is_vllms_own_unless_given():
    events = KVEventsConfig(enable_kv_cache_events=False)
    assert engine_args(worker(), events).max_num_batched_tokens is None
    given = engine_args(worker(max_num_batched_tokens=512), events)
    assert given.max_num_batched_tokens == 512


def test_the_kv_buffer_is_where_the_model_runs():
    args = engine_args(worker(), KVEventsConfig(enable_kv_cache_events=False))
    assert args.kv_transfer_config.kv_buffer_device == "cpu"
    assert args.kv_transfer_config.kv_connector == "NixlConnector"
    assert args.enable_sleep_mode is False  # vLLM's CPU build has none (vllm_sleep.py)


def test_the_block_size_follows_vllms_cpu_attention_and_a_size_it_cannot_run_is_refused():
    def with_block_size(block_size: int) -> WorkerConfig:
        engine = EngineConfig(model_dir=Path("/m"), block_size=block_size, device="cpu")
        return WorkerConfig(
            worker_id="p", role="prefill", model_name="m", engine_kind="vllm", engine=engine
        )

    assert vllm_engine_config(with_block_size(0)).block_size == 32  # unset: its own
    assert vllm_engine_config(with_block_size(64)).block_size == 64
    with pytest.raises(ConfigError, match=r"--block-size 16: .*MultipleOf\(32\)"):
        vllm_engine_config(with_block_size(16))


def test_a_workers_compile_cache_key_does_not_change_with_its_side_channel_port(
    clean_environment, monkeypatch
):
    """vLLM hashes the NIXL side channel's port into its compile cache key, and a worker
    takes a free port at each start: without the plugin each start compiled again."""
    from vllm import envs
    from vllm.compilation.caching import hash_factors

    def key(port: int, factors) -> str:
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(port))
        envs.disable_envs_cache()  # the variables as they are now (an earlier test cached them)
        return hash_factors(factors())

    # vLLM's own (an earlier test may have had vLLM load the plugin in this process)
    vllms = getattr(envs.compile_factors, "__wrapped__", envs.compile_factors)
    assert key(41001, vllms) != key(41002, vllms)
    stable = without_ports(vllms)
    assert key(41001, stable) == key(41002, stable)


def test_vllms_caches_persist_under_splitserve_home(clean_environment, monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_HOME", str(tmp_path))
    set_environment(worker())
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
    assert os.environ[COMPILE_CACHE_ENV] == "1"


def test_a_directory_kept_in_our_gguf_layout_is_refused_by_name(tmp_path):
    listed = json.dumps({"model.layers.0.mlp.down_proj.weight": {"format": "Q4_K"}})
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"), {QUANT_METADATA: listed})
    config = WorkerConfig(
        worker_id="p",
        role="prefill",
        model_name="m",
        engine_kind="vllm",
        engine=EngineConfig(model_dir=tmp_path, block_size=32, device="cpu"),
    )
    with pytest.raises(ConfigError, match=r"keeps GGUF Q4_K in splitserve's own layout"):
        vllm_engine_config(config)


def test_a_w8a8_checkpoint_in_float32_is_refused_by_name(tmp_path):
    scheme = Scheme(QuantFormat.INT8, 8, 0, symmetric=True)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": scheme.config()}))

    def config(dtype: str) -> WorkerConfig:
        engine = EngineConfig(model_dir=tmp_path, block_size=32, device="cpu", dtype=dtype)
        return WorkerConfig(
            worker_id="p", role="prefill", model_name="m", engine_kind="vllm", engine=engine
        )

    with pytest.raises(ConfigError, match=r"W8A8 checkpoint .* not --dtype float32"):
        vllm_engine_config(config("float32"))
    assert vllm_engine_config(config("bfloat16")).block_size == 32
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": fp8}))
    assert vllm_engine_config(config("float32")).block_size == 32  # vLLM's to judge


@pytest.mark.parametrize(
    ("scheme", "device", "message"),
    [
        (Scheme(QuantFormat.FP8_VLLM, 8, 0, True, strategy="tensor"), "cpu", "one scale per"),
        (Scheme(QuantFormat.FP8, 8, 0, True, strategy="tensor"), "cpu", "static_scaled_fp8"),
        (Scheme(QuantFormat.FP8, 8, 64, True, strategy="group"), "cuda", r"group scales \(c-t"),
        (Scheme(QuantFormat.FP8_VLLM, 8, 0, True, strategy="block"), "cpu", None),
        (Scheme(QuantFormat.FP8, 8, 0, True, strategy="channel"), "cpu", None),
    ],
)
def test_fp8_checkpoints_vllm_cannot_run_are_refused_by_name(tmp_path, scheme, device, message):
    """vLLM 0.32 on this CPU runs FP8 per channel and per block (tests/unit/test_vllm_quantized.py);
    per tensor it calls a kernel its CPU build lacks, and FP8 group scales it has no scheme for
    anywhere (refused before the device is probed: this host has no CUDA)."""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": scheme.config()}))
    engine = EngineConfig(model_dir=tmp_path, block_size=32, device=device)
    config = WorkerConfig(
        worker_id="p", role="prefill", model_name="m", engine_kind="vllm", engine=engine
    )
    if message is None:
        assert vllm_engine_config(config).block_size in (16, 32)
        return
    with pytest.raises(ConfigError, match=message):
        vllm_engine_config(config)
