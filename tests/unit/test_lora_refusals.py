"""Bad adapters are refused with a clear error and the engine serves on: missing files,
corrupt safetensors, a rank above --max-lora-rank, shapes of another base model, settings
we cannot serve exactly; requests naming an unknown adapter; bad --lora-modules."""

from __future__ import annotations

import json
import shutil

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.errors import BadAdapter, InvalidRequest
from shared.engine.lora.modules import parse_lora_modules
from shared.engine.sampling_params import SamplingParams
from shared.errors import ConfigError
from tests.conftest import write_tiny_model
from tests.engine_harness import run_to_completion
from tests.lora_adapters import write_adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bad")
    model_dir = write_tiny_model(root / "model", seed=1)
    good = write_adapter(model_dir, root / "good", seed=3)
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir, dtype="float32", num_kv_blocks=32, enable_lora=True,
            max_lora_rank=8,
        )
    )  # fmt: skip
    return root, model_dir, good, engine


def copy_of(good, root, name):
    target = root / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(good, target)
    return target


def edit_config(path, **changes):
    file = path / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def test_bad_adapters_are_refused_and_the_engine_serves_on(setup):
    root, model_dir, good, engine = setup
    missing_weights = copy_of(good, root, "no-weights")
    (missing_weights / "adapter_model.safetensors").unlink()
    corrupt = copy_of(good, root, "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    dora = copy_of(good, root, "dora")
    edit_config(dora, use_dora=True)
    other_base = write_tiny_model(root / "wide", seed=2, hidden_size=32, head_dim=8)
    wrong_shape = write_adapter(other_base, root / "wrong-shape", seed=4)
    too_big = write_adapter(model_dir, root / "rank16", seed=5, r=16)
    cases = {
        root / "nowhere": "no adapter_config.json",
        missing_weights: "no adapter_model.safetensors",
        corrupt: "not a safetensors file",
        dora: "use_dora=True is not supported",
        wrong_shape: "do not fit the base model",
        too_big: "rank 16 is above --max-lora-rank 8",
    }
    for path, message in cases.items():
        with pytest.raises(BadAdapter, match=message):
            engine.load_adapter("bad", path)
        assert engine.adapters is not None and not engine.adapters.knows("bad")
    engine.load_adapter("good", good)
    params = SamplingParams(temperature=0, max_tokens=3, adapter="good")
    engine.add_request("r", [3, 4, 5, 6], params)
    assert len(run_to_completion(engine)["r"]) == 3


def test_requests_and_names_that_name_no_adapter_are_refused(setup):
    _, model_dir, good, engine = setup
    with pytest.raises(InvalidRequest, match="no LoRA adapter 'ghost'"):
        engine.check_request([3, 4], SamplingParams(adapter="ghost"))
    with pytest.raises(InvalidRequest, match="adapter name"):
        engine.load_adapter("bad name", good)
    with pytest.raises(InvalidRequest, match="no adapter 'ghost' is loaded"):
        engine.unload_adapter("ghost")
    plain = LLMEngine(EngineConfig(model_dir=model_dir, dtype="float32", num_kv_blocks=8))
    with pytest.raises(InvalidRequest, match="serves no LoRA adapters"):
        plain.load_adapter("good", good)
    with pytest.raises(InvalidRequest, match="no LoRA adapter"):
        plain.check_request([3, 4], SamplingParams(adapter="good"))


def test_an_adapter_in_use_is_not_unloaded(setup):
    _, _, good, engine = setup
    engine.load_adapter("busy", good)
    engine.add_request("b", [3, 4, 5], SamplingParams(temperature=0, max_tokens=2, adapter="busy"))
    with pytest.raises(InvalidRequest, match="serving requests"):
        engine.unload_adapter("busy")
    run_to_completion(engine)
    engine.unload_adapter("busy")
    with pytest.raises(InvalidRequest, match="no LoRA adapter 'busy'"):
        engine.check_request([3], SamplingParams(adapter="busy"))


@pytest.mark.parametrize(
    "entries, message",
    [
        (("a",), "expected name=path"),
        (("=x",), "adapter name"),
        (("a=x", "a=y"), "given twice"),
        (("bad name=x",), "adapter name"),
    ],
)
def test_bad_lora_modules_are_config_errors(entries, message):
    with pytest.raises(ConfigError, match=message):
        parse_lora_modules(entries)
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model_dir="m", lora_modules=entries)


def test_lora_limits_are_checked():
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig(model_dir="m", max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="positive"):
        EngineConfig(model_dir="m", max_lora_rank=0)
