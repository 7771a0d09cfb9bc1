"""A vLLM general plugin (entry point group `vllm.general_plugins`) that keeps the NIXL agent
of vLLM's NixlConnector from spinning on a core, and has vLLM's compile cache keep and load
what a start compiled (vllm_compile_cache.py).

vLLM makes its agent with NIXL's default config, whose progress thread polls UCX with no
pause between polls: one core busy all the time, idle or not (on a 2-core machine, half of
it, taken from the engine's own threads). Without that thread a transfer progresses
whenever vLLM checks on it, once a step, which is how our own NIXL transport runs
(shared/kvtransfer/nixl_transport.py).

vLLM loads general plugins in each of its processes (the engine core's too). This one acts
only where a splitserve vLLM worker set its variables (vllm_engine_args.set_environment),
so any other vLLM that shares the environment keeps vLLM's defaults.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from services.worker import vllm_compile_cache

QUIET_NIXL_ENV = "SPLITSERVE_VLLM_NIXL_NO_PROGRESS_THREAD"

log = logging.getLogger(__name__)


def register() -> None:
    vllm_compile_cache.register()
    if os.environ.get(QUIET_NIXL_ENV) != "1":
        return
    from vllm.distributed import nixl_utils

    config_class = nixl_utils.nixl_agent_config  # None without NIXL: nothing to change
    if config_class is None or getattr(config_class, "splitserve_quiet", False):
        return
    nixl_utils.nixl_agent_config = quiet(config_class)
    log.info("splitserve: vLLM's NIXL agents run without a progress thread")


def quiet(config_class: Any) -> Any:
    """`config_class` with `enable_prog_thread` off unless a caller sets it."""

    @functools.wraps(config_class)
    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        return config_class(*args, **kwargs)

    make.splitserve_quiet = True  # type: ignore[attr-defined]
    return make
