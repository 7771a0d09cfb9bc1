"""Attention backends over the paged KV cache, chosen by name (`torch`; more later)."""

from __future__ import annotations

from shared.engine.attention.base import AttentionBackend
from shared.engine.attention.torch_backend import TorchAttention

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def get_backend(name: str) -> AttentionBackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"attention backend {name!r} is not available (have: {', '.join(BACKENDS)})"
        ) from None
