"""vLLM's compile cache in a splitserve worker (services/worker/vllm_compile_cache.py): the
side channel's port is no part of the key, and torch's inductor artifact gets the
`finalize_loading` vLLM 0.32's loader calls, on vLLM 0.32 only, in a worker's processes only.
vLLM itself is a stand-in here (its version is what is asked); torch's artifact class is the
real one. (A real second start that loads the cache:
tests/integration/test_vllm_compile_cache.py.)"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest
from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Artifact

from services.worker.vllm_compile_cache import (
    COMPILE_CACHE_ENV,
    MENDED_VLLM,
    loaded_already,
    register,
)

if vars(Artifact).get("finalize_loading", loaded_already) is not loaded_already:
    pytest.skip("this torch's artifact has a finalize_loading of its own", allow_module_level=True)


def stand_in_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> types.ModuleType:
    """vllm and vllm.envs: a version and two compile cache factors."""
    envs = types.ModuleType("vllm.envs")
    envs.compile_factors = lambda: {"VLLM_NIXL_SIDE_CHANNEL_PORT": 41234, "VLLM_PP": "0,1"}
    vllm = types.ModuleType("vllm")
    vllm.envs = envs
    vllm.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    return envs


def unmend() -> None:
    if vars(Artifact).get("finalize_loading") is loaded_already:
        del Artifact.finalize_loading


@pytest.fixture
def artifact_class() -> Iterator[type]:
    """torch's artifact class as torch has it (an earlier vLLM start in this process may
    have mended it), before the test and after."""
    unmend()
    yield Artifact
    unmend()


def compiled(*args: object) -> str:
    """What inductor's compiled function stands for: a plain function."""
    return f"ran {args}"


compiled.serialize = lambda: b""  # what torch's wrapper asks of what it wraps


def test_in_a_worker_the_side_channel_port_is_no_compile_factor(monkeypatch, artifact_class):
    envs = stand_in_vllm(monkeypatch, "0.0.test")
    monkeypatch.setenv(COMPILE_CACHE_ENV, "1")
    register()
    register()  # vLLM may load plugins more than once in a process: wrapped once
    assert envs.compile_factors() == {"VLLM_PP": "0,1"}
    assert envs.compile_factors.__wrapped__() == {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": 41234,
        "VLLM_PP": "0,1",
    }


def test_on_vllm_0_32_torchs_inductor_artifact_finishes_loading(monkeypatch, artifact_class):
    stand_in_vllm(monkeypatch, MENDED_VLLM)
    monkeypatch.setenv(COMPILE_CACHE_ENV, "1")
    loaded = artifact_class(compiled)
    # what vLLM 0.32's loader met: the wrapper hands the name on to the function it holds
    with pytest.raises(AttributeError, match="'function' object has no attribute 'finalize"):
        loaded.finalize_loading(object())
    register()
    register()
    assert loaded.finalize_loading(object()) is None
    assert loaded(1, 2) == "ran (1, 2)"  # the loaded function runs as it did


def test_on_another_vllm_its_loader_is_left_as_it_is_and_the_log_says_so(
    monkeypatch, artifact_class, caplog
):
    stand_in_vllm(monkeypatch, "0.33.0")
    monkeypatch.setenv(COMPILE_CACHE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="services.worker.vllm_compile_cache"):
        register()
    assert not hasattr(artifact_class, "finalize_loading")
    assert "vLLM 0.33.0, not 0.32.0: its compile cache loader is left as it is" in caplog.text


def test_any_other_vllm_process_keeps_vllms_key_and_loader(monkeypatch, artifact_class):
    envs = stand_in_vllm(monkeypatch, MENDED_VLLM)
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    register()
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in envs.compile_factors()
    assert not hasattr(artifact_class, "finalize_loading")
