"""Attention backends over the paged KV cache, chosen by name.

`torch` is the reference; `cpu` runs the C++ kernels of csrc/cpu (when built); `triton`
runs the Triton kernels (CUDA tensors, or anywhere under TRITON_INTERPRET=1); `auto` is
`triton` on a CUDA device, and on the CPU `cpu` when its kernels are built, else `torch`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine import native
from shared.engine.attention.base import AttentionBackend
from shared.engine.attention.torch_backend import TorchAttention
from shared.errors import ConfigError


def _cpu() -> AttentionBackend:
    from shared.engine.attention.cpu_backend import CpuAttention

    return CpuAttention()


def _triton() -> AttentionBackend:
    from shared.engine.attention.triton_backend import TritonAttention

    return TritonAttention()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttention,
    "cpu": _cpu,
    "triton": _triton,
}


CPU = torch.device("cpu")


def resolve_backend(name: str, device: torch.device = CPU) -> str:
    """The concrete backend `name` stands for on `device` (`auto` picks; other names stand
    for themselves)."""
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if native.load() is not None else "torch"
    return name


def get_backend(name: str, device: torch.device = CPU) -> AttentionBackend:
    try:
        factory = BACKENDS[resolve_backend(name, device)]
    except KeyError:
        raise ConfigError(
            f"attention backend {name!r} is not available (have: auto, {', '.join(BACKENDS)})"
        ) from None
    return factory()
