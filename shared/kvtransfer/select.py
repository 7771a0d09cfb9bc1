"""Choosing a worker's one-sided KV transport: `make_transport` never crashes a worker.

| wanted | result |
|---|---|
| `"nats"` | None: KV moves over NATS |
| `"auto"` | a `NixlTransport` where NIXL loads and starts, else None (one WARNING says why) |
| `"nixl"` | a `NixlTransport`, or TransportUnavailable saying why not |
"""

from __future__ import annotations

import logging

import torch

from shared.errors import ConfigError
from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.nixl_transport import NixlTransport, nixl_available
from shared.kvtransfer.transfer import TransportUnavailable

log = logging.getLogger(__name__)

WANTED = ("auto", "nixl", "nats")


def make_transport(
    agent_name: str, layers: list[torch.Tensor], layout: KVLayout, wanted: str
) -> NixlTransport | None:
    """The transport for this worker's cache `layers`; ConfigError for an unknown `wanted`,
    ValueError for `layers` that do not fit `layout`."""
    if wanted not in WANTED:
        raise ConfigError(f"KV transport must be one of {WANTED}, not {wanted!r}")
    if wanted == "nats":
        return None
    ok, why = nixl_available()
    try:
        if ok:
            return NixlTransport(agent_name, layers, layout)
    except TransportUnavailable as exc:
        why = str(exc)
    if wanted == "nixl":
        raise TransportUnavailable(f"NIXL unavailable ({why})")
    log.warning("NIXL unavailable (%s): KV moves over NATS", why)
    return None
