"""The vLLM plugin that turns off the NIXL agent's spinning progress thread: declared where
vLLM looks for plugins, acting only in a splitserve vLLM worker's processes, and leaving a
caller's explicit choice alone. (Its effect on a real mesh: tests/e2e/test_vllm_engine.py;
its compile cache part: test_vllm_compile_cache.py.)"""

from __future__ import annotations

import sys
import types
from importlib.metadata import entry_points

import pytest

from services.worker import vllm_nixl_plugin
from services.worker.vllm_compile_cache import COMPILE_CACHE_ENV
from services.worker.vllm_nixl_plugin import QUIET_NIXL_ENV, register


class AgentConfig:
    """NIXL's nixl_agent_config, reduced to the argument in question."""

    def __init__(self, enable_prog_thread: bool = True, num_threads: int = 0) -> None:
        self.enable_prog_thread = enable_prog_thread
        self.num_threads = num_threads


@pytest.fixture
def nixl_utils(monkeypatch):
    """A stand-in for vllm.distributed.nixl_utils (vLLM is not in every test venv)."""
    module = types.ModuleType("vllm.distributed.nixl_utils")
    module.nixl_agent_config = AgentConfig
    distributed = types.ModuleType("vllm.distributed")
    distributed.nixl_utils = module
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", distributed)
    monkeypatch.setitem(sys.modules, "vllm.distributed.nixl_utils", module)
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)  # its part: test_vllm_compile_cache.py
    return module


def test_the_plugin_is_declared_in_vllms_plugin_group():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("splitserve_quiet_nixl") == "services.worker.vllm_nixl_plugin:register"


def test_in_a_splitserve_worker_agents_default_to_no_progress_thread(nixl_utils, monkeypatch):
    monkeypatch.setenv(QUIET_NIXL_ENV, "1")
    register()
    register()  # vLLM may load plugins more than once in a process: wrapped once
    config = nixl_utils.nixl_agent_config(num_threads=4)
    assert config.enable_prog_thread is False and config.num_threads == 4
    assert nixl_utils.nixl_agent_config(enable_prog_thread=True).enable_prog_thread is True
    assert nixl_utils.nixl_agent_config.__wrapped__ is AgentConfig


def test_any_other_vllm_keeps_its_defaults(nixl_utils, monkeypatch):
    monkeypatch.delenv(QUIET_NIXL_ENV, raising=False)
    register()
    assert nixl_utils.nixl_agent_config is AgentConfig


def test_without_nixl_there_is_nothing_to_change(nixl_utils, monkeypatch):
    monkeypatch.setenv(QUIET_NIXL_ENV, "1")
    nixl_utils.nixl_agent_config = None
    register()
    assert nixl_utils.nixl_agent_config is None
    assert vllm_nixl_plugin.quiet(AgentConfig)().enable_prog_thread is False
