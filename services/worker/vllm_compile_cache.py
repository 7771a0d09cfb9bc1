"""vLLM's compile cache in a splitserve worker: one key for the same model and settings, and
a load that takes what an earlier start compiled (issue 61).

Key: vLLM keys its compile cache (torch.compile's artifacts, under VLLM_CACHE_ROOT) by a hash
of its config and of every VLLM_* variable it does not list as irrelevant to the graph. It
lists VLLM_NIXL_SIDE_CHANNEL_HOST, not VLLM_NIXL_SIDE_CHANNEL_PORT; a worker takes a free
port for that side channel at each start, so each start had a key of its own. The port is
left out of the key as the host is.

Load: on a CPU vLLM compiles with torch's inductor backend (mode DYNAMO_TRACE_ONCE), and
torch saves that artifact as its own `BundledAOTAutogradSerializableCallable`. vLLM 0.32's
loader (vllm.compilation.decorators._try_load_aot_compiled_fn) ends every load with
`compiled_fn.finalize_loading(vllm_config)`, a method of vLLM's own artifact (its backend is
built there); torch's wrapper hands the unknown attribute on to the compiled function it
holds, which has none: "'function' object has no attribute 'finalize_loading'", taken as a
failed load, and the model compiled again. Torch's artifact is complete once deserialized,
so it gets a `finalize_loading` that does nothing, as vLLM's own does once nothing is left
to load.

The subtle rule: the load is mended on vLLM `MENDED_VLLM` only, whose loader this was read
from; on any other version the worker says so in its log and leaves vLLM as it is (it
compiles at each start unless it loads its cache by itself). Both act only where a
splitserve vLLM worker set `COMPILE_CACHE_ENV` (vllm_engine_args.set_environment).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

COMPILE_CACHE_ENV = "SPLITSERVE_VLLM_COMPILE_CACHE"
# Where a peer reaches this engine, not what it computes (vLLM leaves the host out already).
NOT_GRAPH_FACTORS = ("VLLM_NIXL_SIDE_CHANNEL_PORT",)
MENDED_VLLM = "0.32.0"

log = logging.getLogger(__name__)


def register() -> None:
    """In a splitserve vLLM worker's processes: the stable key and the mended load."""
    if os.environ.get(COMPILE_CACHE_ENV) != "1":
        return
    _stable_compile_key()
    mend_inductor_load()


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


def mend_inductor_load() -> bool:
    """Give torch's inductor artifact the `finalize_loading` vLLM's loader calls. True when
    it has one (mended now or before, or torch's own), False when left alone (logged)."""
    import vllm

    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:
        log.warning("splitserve: this torch saves no inductor AOT artifact; nothing to mend")
        return False
    if hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading"):
        return True
    if vllm.__version__ != MENDED_VLLM:
        log.warning(
            "splitserve: vLLM %s, not %s: its compile cache loader is left as it is (a start "
            "that fails to load the cache compiles the model again)",
            vllm.__version__,
            MENDED_VLLM,
        )
        return False
    BundledAOTAutogradSerializableCallable.finalize_loading = loaded_already  # type: ignore[attr-defined]
    log.info("splitserve: vLLM %s loads torch's inductor artifacts from its cache", MENDED_VLLM)
    return True


def loaded_already(artifact: Any, vllm_config: Any) -> None:
    """Torch's inductor artifact is ready once deserialized: nothing is left to load."""
