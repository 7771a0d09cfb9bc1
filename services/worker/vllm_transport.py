"""`VllmNixlTransport`: the one-sided transport of vLLM workers, where vLLM does the READ.

Between two vLLM workers KV moves through vLLM's own NixlConnector: the prefill engine
keeps a finished prompt's blocks for a peer, the decode engine pulls them when the request
enters it with the prefill engine's `kv_transfer_params` (our `KVReady.engine_params`).
The mesh's one-sided transfer (shared/kvtransfer/one_sided.py) is the same as for any
transport: the decode side checks the offered blocks against the reservation, then
`start_decode` hands the request to vLLM, which READs. So this transport's `start_read`
has nothing left to move and answers SUCCESS; a failed pull comes back as the request's
failure from the engine.
Its `metadata` is empty: where to READ from travels per request in `engine_params`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shared.kvtransfer import KVLayout
from shared.kvtransfer.transfer import TransferState

NAME = "vllm-nixl"


class _PulledByEngine:
    """The READ of a request whose blocks the decode engine pulls itself."""

    error = ""

    def poll(self) -> TransferState:
        return TransferState.SUCCESS

    def release(self) -> None:
        """Nothing is held."""


class VllmNixlTransport:
    name = NAME

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks

    def metadata(self) -> bytes:
        return b""

    def connect(self, peer: str, metadata: bytes, num_blocks: int) -> None:
        """vLLM's connector meets its peer on the first pull (its own side channel)."""

    def start_read(
        self, peer: str, remote_blocks: list[int], local_blocks: list[int]
    ) -> _PulledByEngine:
        if len(remote_blocks) != len(local_blocks):
            raise ValueError(f"{len(remote_blocks)} blocks offered for {len(local_blocks)}")
        return _PulledByEngine()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """vLLM's connector answers its peers by itself."""
        yield

    def close(self) -> None:
        """vLLM's connector stops with its engine."""
