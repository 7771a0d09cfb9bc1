"""A vLLM general plugin (entry point group `vllm.general_plugins`) that keeps the NIXL agent
of vLLM's NixlConnector from spinning on a core, and the NIXL side channel's port out of
vLLM's compile cache key.

vLLM makes its agent with NIXL's default config, whose progress thread polls UCX with no
pause between polls: one core busy all the time, idle or not (on a 2-core machine, half of
it, taken from the engine's own threads). Without that thread a transfer progresses
whenever vLLM checks on it, once a step, which is how our own NIXL transport runs
(shared/kvtransfer/nixl_transport.py).

vLLM keys its compile cache (torch.compile's graphs, under VLLM_CACHE_ROOT) by a hash of
its config and of every VLLM_* variable it does not list as irrelevant to the graph. It
lists VLLM_NIXL_SIDE_CHANNEL_HOST, not VLLM_NIXL_SIDE_CHANNEL_PORT; a worker takes a free
port for that side channel at each start, so each start had a key of its own and compiled
the model again (minutes on a CPU). With `STABLE_COMPILE_KEY_ENV` set, the port is left out
of the key as the host is: the same model and settings load what an earlier start compiled.

vLLM loads general plugins in each of its processes (the engine core's too). This one acts
only where a splitserve vLLM worker set its variables (vllm_engine_args.set_environment),
so any other vLLM that shares the environment keeps vLLM's defaults.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

QUIET_NIXL_ENV = "SPLITSERVE_VLLM_NIXL_NO_PROGRESS_THREAD"
STABLE_COMPILE_KEY_ENV = "SPLITSERVE_VLLM_COMPILE_KEY_WITHOUT_PORT"
# Where a peer reaches this engine, not what it computes (vLLM leaves the host out already).
NOT_GRAPH_FACTORS = ("VLLM_NIXL_SIDE_CHANNEL_PORT",)

log = logging.getLogger(__name__)


def register() -> None:
    if os.environ.get(STABLE_COMPILE_KEY_ENV) == "1":
        _stable_compile_key()
    if os.environ.get(QUIET_NIXL_ENV) != "1":
        return
    from vllm.distributed import nixl_utils

    config_class = nixl_utils.nixl_agent_config  # None without NIXL: nothing to change
    if config_class is None or getattr(config_class, "splitserve_quiet", False):
        return
    nixl_utils.nixl_agent_config = quiet(config_class)
    log.info("splitserve: vLLM's NIXL agents run without a progress thread")


def _stable_compile_key() -> None:
    from vllm import envs

    if getattr(envs.compile_factors, "splitserve_stable", False):
        return
    envs.compile_factors = without_ports(envs.compile_factors)


def without_ports(compile_factors: Any) -> Any:
    """`compile_factors` without the variables of `NOT_GRAPH_FACTORS`."""

    @functools.wraps(compile_factors)
    def factors() -> dict[str, object]:
        every = compile_factors()
        return {name: value for name, value in every.items() if name not in NOT_GRAPH_FACTORS}

    factors.splitserve_stable = True  # type: ignore[attr-defined]
    return factors


def quiet(config_class: Any) -> Any:
    """`config_class` with `enable_prog_thread` off unless a caller sets it."""

    @functools.wraps(config_class)
    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        return config_class(*args, **kwargs)

    make.splitserve_quiet = True  # type: ignore[attr-defined]
    return make
