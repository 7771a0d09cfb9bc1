"""`resolve(config)`: an `EngineConfig` made concrete for this machine, when an engine is built.

A config's `auto` settings are questions for the hardware, answered here and nowhere else:
the device (cuda when torch sees a GPU, else cpu), the block size (0: the native engine's
16; a vLLM worker sets its own first, services/worker/vllm_engine_args.py), batch_invariant
(on when the C++ kernels are built, the weights are float or w8a8 and attention runs on
the CPU; loading the kernels may build them) and the dtype (model_config.auto_dtype, which
asks whether our kernels run the matmuls). The subtle rule: they resolve in that order,
each reading the ones before, and the resolved config passes EngineConfig's checks again
against the concrete device.
"""

from __future__ import annotations

from dataclasses import replace

from shared.engine import batch_invariant
from shared.engine.engine_config import NATIVE_BLOCK_SIZE, EngineConfig
from shared.engine.model_config import auto_dtype


def resolve(config: EngineConfig) -> EngineConfig:
    """`config` with a concrete device, batch_invariant and dtype. ValueError for a device
    that is not there (or one that contradicts a setting); RuntimeError for batch_invariant
    insisted on without the kernels it needs."""
    device = config.torch_device
    config = replace(config, device=str(device), block_size=config.block_size or NATIVE_BLOCK_SIZE)
    invariant = batch_invariant.resolve(config)
    dtype = config.dtype
    if dtype == "auto":
        dtype = auto_dtype(config.model_dir, device.type, config.quantization, invariant)
    return replace(config, batch_invariant=invariant, dtype=dtype)
