"""The packed-weight cache (shared/engine/model/packed_cache.py, packed_start.py): the first
engine of a checkpoint packs and writes it, the next maps it (phase `weights_mapped`, no
load or pack) and streams the same seeded tokens; a file made for other weights, for
another kernel layout, truncated or not a cache file is refused and rebuilt."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from shared.engine import native
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.model import packed_cache
from shared.engine.model.linear_weights import PackedGateUp, PackedLinear
from shared.engine.model.packed_start import PackedCache
from shared.engine.sampling_params import SamplingParams
from shared.engine.startup_phases import StartupPhase
from tests.conftest import PACKED_CACHE_OF, write_tiny_model
from tests.engine_harness import run_to_completion

pytestmark = pytest.mark.skipif(native.load() is None, reason="needs the C++ kernels")
PROMPT = [(7 * i) % 200 + 3 for i in range(30)]
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)


@pytest.fixture(autouse=True)
def cache_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache as it runs outside the tests, in this test's own directory."""
    monkeypatch.setattr(PackedCache, "of", PACKED_CACHE_OF)
    monkeypatch.setattr(packed_cache, "cache_home", lambda: tmp_path / "packed")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny", seed=4)


def start(model_dir: Path) -> tuple[LLMEngine, dict[StartupPhase, float]]:
    config = EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", num_kv_blocks=16,
                          batch_invariant=True)  # fmt: skip
    engine = LLMEngine(config)
    return engine, dict(engine.startup.seconds)


def tokens(engine: LLMEngine) -> list[int]:
    engine.add_request("r", PROMPT, SEEDED)
    return run_to_completion(engine)["r"]


def test_the_second_start_maps_what_the_first_packed(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="shared.engine.model.packed_start")
    first, phases = start(model_dir)
    path = packed_cache.cache_path(model_dir)
    assert path.is_file() and "none yet; packing" in caplog.text
    assert StartupPhase.WEIGHTS_LOAD in phases and StartupPhase.WEIGHTS_MAPPED not in phases
    second, phases = start(model_dir)
    assert "mapped, not packed again" in caplog.text
    assert StartupPhase.WEIGHTS_MAPPED in phases and StartupPhase.WEIGHTS_LOAD not in phases
    head = second.runner.model.weights.lm_head
    assert (
        isinstance(head, PackedLinear) and head is second.runner.model.weights.lm_head_column_major
    )
    assert isinstance(second.runner.model.weights.layers[0].gate_up, PackedGateUp)
    assert tokens(second) == tokens(first)


def refused_then_rebuilt(model_dir: Path, caplog, says: str) -> None:
    caplog.clear()
    engine, phases = start(model_dir)
    assert says in caplog.text and StartupPhase.WEIGHTS_LOAD in phases, caplog.text
    caplog.clear()
    _, phases = start(model_dir)  # rebuilt: mapped again
    assert StartupPhase.WEIGHTS_MAPPED in phases and StartupPhase.WEIGHTS_LOAD not in phases
    assert tokens(engine) == tokens(start(model_dir)[0])


def test_other_weights_are_refused_and_rebuilt(model_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="shared.engine.model.packed_start")
    before = tokens(start(model_dir)[0])
    other = write_tiny_model(tmp_path / "other", seed=9)
    shutil.copy(other / "model.safetensors", model_dir / "model.safetensors")
    refused_then_rebuilt(model_dir, caplog, "made for other weights")
    assert tokens(start(model_dir)[0]) != before  # the new weights' tokens, not the cache's


def test_another_kernel_layout_is_refused_and_rebuilt(model_dir, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="shared.engine.model.packed_start")
    start(model_dir)
    monkeypatch.setattr(packed_cache, "PACK_LAYOUT", packed_cache.PACK_LAYOUT + 1)
    refused_then_rebuilt(model_dir, caplog, "another kernel layout")


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda data: data[: len(data) - 4096], "truncated"),
        (lambda data: data + b"\0" * 10, "truncated"),
        (lambda data: b"garbage" + data, "not a packed-weight file"),
        (lambda data: data[:12], "unreadable"),
    ],
)
def test_a_damaged_file_is_refused_and_rebuilt(model_dir, caplog, damage, says):
    caplog.set_level(logging.INFO, logger="shared.engine.model.packed_start")
    start(model_dir)
    path = packed_cache.cache_path(model_dir)
    path.write_bytes(damage(path.read_bytes()))
    refused_then_rebuilt(model_dir, caplog, says)


def test_the_dtype_is_part_of_the_key(model_dir):
    f32 = packed_cache.cache_key(model_dir, torch.float32, True)
    assert f32 != packed_cache.cache_key(model_dir, torch.bfloat16, True)
    assert f32 != packed_cache.cache_key(model_dir, torch.float32, False)
