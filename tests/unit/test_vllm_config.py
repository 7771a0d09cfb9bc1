"""`--engine`: a flag of every worker (and of `up`, compose and k8s through SPLITSERVE_*),
native by default; what a vLLM worker cannot take is refused naming the flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.worker.cli import add_arguments, config_from_args
from services.worker.config import WorkerConfig
from shared.engine.engine_config import EngineConfig


def parse(argv: list[str]) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--model-dir", "/m", *argv]))


def test_native_by_default_and_vllm_by_flag_or_variable(monkeypatch):
    assert parse([]).engine_kind == "native"
    assert parse(["--engine", "vllm"]).engine_kind == "vllm"
    monkeypatch.setenv("SPLITSERVE_ENGINE_KIND", "vllm")
    assert parse([]).engine_kind == "vllm"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--kv-transport", "nats"], "--kv-transport nats"),
        (["--quantization", "int8"], "--quantization"),
        (["--group-quant-activations", "int8"], "--group-quant-activations"),
        (["--speculative", "ngram"], "--speculative"),
        (["--num-kv-blocks", "64"], "--num-kv-blocks"),
        (["--kv-offloading-size", "1"], "--kv-offloading-size"),
    ],
)
def test_native_only_options_are_refused_with_vllm(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse(["--engine", "vllm", *argv])


def test_a_numbered_gpu_is_refused_with_vllm_naming_the_variable(monkeypatch):
    import torch

    # As on a host with two GPUs: the device resolves, then the vLLM worker refuses it.
    monkeypatch.setattr(
        "shared.engine.engine_config.resolve_device", lambda name: torch.device(name)
    )
    with pytest.raises(ValueError, match=r"--device cuda:1: .*CUDA_VISIBLE_DEVICES"):
        parse(["--engine", "vllm", "--device", "cuda:1", "--dtype", "bfloat16"])


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine must be one of"):
        WorkerConfig(
            worker_id="w",
            role="both",
            model_name="m",
            engine_kind="sglang",
            engine=EngineConfig(model_dir=Path("/m")),
        )
