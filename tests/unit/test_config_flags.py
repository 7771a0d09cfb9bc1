"""Flags generated from the config dataclasses (shared/flags.py): every engine setting is a
flag of `splitserve worker` and `splitserve up` with a `SPLITSERVE_*` default, a bad
variable is refused by name, the flags build the dataclasses back, what `up` forwards reads
back as the same engine config, and flag parsing never imports torch."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from services.cannot_run import CANNOT_RUN
from services.cli import build_parser
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker import cli as worker_cli
from services.worker.config import WorkerConfig
from shared.config import CommonConfig
from shared.engine.engine_config import EngineConfig
from shared.flags import flag_names, settings
from shared.nats_options import NatsAuth

# A value other than the default for each engine flag (model_dir: the worker's --model-dir).
CHANGED = {
    "dtype": "bfloat16",
    "device": "cpu",
    "block_size": 32,
    "kv_cache_gib": 0.5,
    "num_kv_blocks": 100,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "max_model_len": 1024,
    "enable_prefix_caching": False,
    "kv_offloading_size": 1.5,
    "kv_offloading_dir": "/tier",
    "attention_backend": "torch",
    "batch_invariant": False,
    "packed_cache": False,
    "num_threads": 3,
    "quantization": "int8",
    "group_quant_activations": "int8",
    "speculative": "draft",
    "num_speculative_tokens": 2,
    "draft_model_dir": Path("/draft"),
    "enable_lora": True,
    "lora_modules": ("a=/adapters/a", "b=/adapters/b"),
    "max_loras": 2,
    "max_lora_rank": 8,
    "max_cpu_loras": 3,
}


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser


def test_every_engine_field_but_the_derived_model_id_is_a_flag():
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model_id"}
    assert set(flag_names(EngineConfig)) == fields
    assert set(CHANGED) == fields - {"model_dir"}


def test_the_readme_names_every_engine_flag():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert [s.option for s in settings(EngineConfig) if f"`{s.option}" not in readme] == []


def test_what_up_forwards_builds_the_same_engine_config_in_the_worker():
    up = build_parser().parse_args(["up"])
    for name, value in CHANGED.items():
        setattr(up, name, value)
    argv = worker_cli.engine_argv(up)
    args = worker_parser().parse_args(["--model-dir", "/m", *argv])
    config = worker_cli.config_from_args(args)
    assert {name: getattr(config.engine, name) for name in CHANGED} == CHANGED
    assert worker_cli.engine_argv(build_parser().parse_args(["up"])) == ()


def test_worker_flags_build_the_worker_config():
    args = worker_parser().parse_args(
        ["--role", "decode", "--model-dir", "/models/tiny", "--worker-id", "d7"]
    )
    config = worker_cli.config_from_args(args)
    assert (config.worker_id, config.role, config.model_name) == ("d7", "decode", "tiny")
    assert config.model_dir == Path("/models/tiny") and config.engine.num_threads is None
    assert config.engine_config().model_id == "tiny"


def test_engine_variables_are_the_defaults(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_DTYPE", "float16")
    monkeypatch.setenv("SPLITSERVE_BATCH_INVARIANT", "false")
    monkeypatch.setenv("SPLITSERVE_DRAFT_MODEL_DIR", "/d")
    monkeypatch.setenv("SPLITSERVE_SPECULATIVE", "draft")
    args = worker_parser().parse_args(["--model-dir", "/m"])
    engine = worker_cli.config_from_args(args).engine
    assert (engine.dtype, engine.batch_invariant) == ("float16", False)
    assert (engine.speculative, engine.draft_model_dir) == ("draft", Path("/d"))
    assert worker_parser().parse_args(["--model-dir", "/m", "--dtype", "float32"]).dtype == (
        "float32"
    )


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SPLITSERVE_DTYPE", "fp8"),
        ("SPLITSERVE_MAX_NUM_SEQS", "many"),
        ("SPLITSERVE_ENABLE_PREFIX_CACHING", "maybe"),
    ],
)
def test_a_bad_variable_is_refused_by_name(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit, match=f"{variable}='{value}'"):
        worker_parser()


def test_an_impossible_engine_config_exits_with_its_reason(capsys):
    args = worker_parser().parse_args(["--model-dir", "/m", "--speculative", "draft"])
    with pytest.raises(SystemExit) as exited:
        worker_cli.main(args)
    assert exited.value.code == CANNOT_RUN  # not restarted by `up`
    assert "needs a draft_model_dir" in capsys.readouterr().err


def test_worker_config_keeps_its_own_checks():
    engine = EngineConfig(model_dir=Path("/m"))
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerConfig(worker_id="w", role="router", model_name="m", engine=engine)
    with pytest.raises(ValueError, match="kv_window"):
        WorkerConfig(worker_id="w", role="both", model_name="m", engine=engine, kv_window=0)


def test_the_step_budget_is_the_engines_own_unless_given():
    assert EngineConfig(model_dir=Path("/m"), device="cpu").token_budget == 256
    given = EngineConfig(model_dir=Path("/m"), device="cpu", max_num_batched_tokens=96)
    assert given.token_budget == 96
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        EngineConfig(model_dir=Path("/m"), max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="must be positive"):
        EngineConfig(model_dir=Path("/m"), max_num_batched_tokens=0)


@pytest.mark.parametrize(
    "module",
    [
        "shared.engine.engine_config",
        "services.worker.cli",
        "services.launcher",
        "services.launch_cli",
        "services.cli",
    ],
)
def test_flag_parsing_does_not_import_torch(module):
    code = (
        f"import sys, {module}\n"
        "from services.cli import build_parser\n"
        "build_parser().parse_args(['up', '--cors-origins', '*', '--quantization', 'int8'])\n"
        "sys.exit('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr.decode() or "torch was imported"


def test_building_the_configs_imports_no_torch_and_leaves_auto_as_auto():
    """A worker's config is made (and checked) without torch, the hardware or the C++
    kernels: `auto` is answered when the engine is built (shared/engine/resolve.py)."""
    code = (
        "import sys\n"
        "from services.cli import build_parser\n"
        "from services.worker.cli import config_from_args\n"
        "from services.scheduler.config import SchedulerConfig\n"
        "args = build_parser().parse_args(['worker', '--model-dir', '/none', '--device', 'cuda'])\n"
        "engine = config_from_args(args).engine\n"
        "assert (engine.dtype, engine.device, engine.batch_invariant) == ('auto', 'cuda', None)\n"
        "SchedulerConfig.from_args(build_parser().parse_args(['scheduler']))\n"
        "sys.exit(sorted({'torch', 'shared.engine.native'} & set(sys.modules)) or 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr.decode()


def test_the_common_flags_build_one_config_nested_in_every_service(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4318")
    monkeypatch.setenv("SPLITSERVE_NAMESPACE", "blue")
    common = ["--nats", "nats://a:1", "--nats-user", "u", "--log-level", "DEBUG"]
    worker = build_parser().parse_args(["worker", "--model-dir", "/m", *common])
    scheduler = build_parser().parse_args(["scheduler", *common])
    gateway = build_parser().parse_args(["gateway", "--model-dir", "/m", "--max-model-len", "64"])
    expected = CommonConfig("nats://a:1", "blue", "DEBUG", "http://otel:4318", NatsAuth("u"))
    assert worker_cli.config_from_args(worker).common == expected
    assert SchedulerConfig.from_args(scheduler).common == expected
    assert GatewayConfig.from_args(gateway).common == CommonConfig(
        "nats://127.0.0.1:4222", "blue", "INFO", "http://otel:4318", NatsAuth()
    )


def test_a_list_setting_reads_commas_and_repeats_and_a_flag_replaces_its_variable(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_API_KEYS", "k1, k2")
    gateway = ["gateway", "--model-dir", "/m"]
    assert build_parser().parse_args(gateway).api_keys == ("k1", "k2")
    args = build_parser().parse_args([*gateway, "--api-key", "k3", "--api-key", "k4,k5"])
    assert args.api_keys == ("k3", "k4", "k5")
