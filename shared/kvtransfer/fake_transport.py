"""The `fake` KV transport: the `KVTransport` shape in one process, for tests without NIXL.

Several `FakeTransport`s share one `FakeFabric` (their "network"): a READ copies the
remote cache's blocks into the local one on its first `poll`. The fabric can fail or stall
the READs from a peer, and `remove` a peer as if its process died, so the failure paths of
the workers can be driven by hand. Id checks are the same as the `nixl` transport's.

The subtle rule, NIXL's own: releasing a READ in flight does not stop it. A stalled READ
whose handle is released still lands when its stall is cleared (`set_fault`), in whatever
the local blocks hold by then (tests/integration/test_nixl_transport.py shows NIXL doing so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

import torch

from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.read_plan import check_cache, check_read
from shared.kvtransfer.transfer import TransferState


class ReadFault(Enum):
    NONE = "none"
    FAIL = "fail"  # the READ ends FAILED, nothing written
    STALL = "stall"  # the READ stays TRANSFERRING until the fault is cleared


@dataclass(slots=True)
class FakeFabric:
    transports: dict[str, FakeTransport] = field(default_factory=dict)  # by agent name
    faults: dict[str, ReadFault] = field(default_factory=dict)  # of READs from that agent
    released: list[FakeReadHandle] = field(default_factory=list)  # in flight, handle freed

    def set_fault(self, peer: str, fault: ReadFault) -> None:
        """READs from `peer` fail or stall from now on, or (NONE) go on: the stalled ones
        whose handles were released land now, as NIXL's would."""
        self.faults[peer] = fault
        if fault != ReadFault.STALL:
            landing = [h for h in self.released if h.peer == peer]
            self.released = [h for h in self.released if h.peer != peer]
            for handle in landing:
                handle.poll()

    def remove(self, agent_name: str) -> None:
        """`agent_name` is gone: READs from it fail from now on, even ones already started."""
        self.transports.pop(agent_name, None)


@dataclass(slots=True)
class FakeReadHandle:
    fabric: FakeFabric
    local: FakeTransport
    peer: str
    remote_blocks: list[int]
    local_blocks: list[int]
    state: TransferState = TransferState.TRANSFERRING
    reason: str = ""

    @property
    def error(self) -> str:
        return self.reason

    def poll(self) -> TransferState:
        if self.state != TransferState.TRANSFERRING:
            return self.state
        fault = self.fabric.faults.get(self.peer, ReadFault.NONE)
        remote = self.fabric.transports.get(self.peer)
        if fault == ReadFault.STALL and remote is not None:
            return self.state
        if remote is None or fault == ReadFault.FAIL:
            self.state = TransferState.FAILED
            self.reason = f"peer {self.peer!r} is gone" if remote is None else "injected failure"
            return self.state
        src = torch.tensor(self.remote_blocks, dtype=torch.int64)
        dst = torch.tensor(self.local_blocks, dtype=torch.int64)
        for mine, theirs in zip(self.local.layers, remote.layers, strict=True):
            # [blocks, block_size, 2, kv_heads, head_dim] rows, gathered then scattered
            mine.index_copy_(0, dst.to(mine.device), theirs.index_select(0, src.to(theirs.device)))
        self.state = TransferState.SUCCESS
        return self.state

    def release(self) -> None:
        """As NIXL's: a READ in flight is not stopped (it lands when its stall clears)."""
        if self.state == TransferState.TRANSFERRING:
            self.fabric.released.append(self)


class FakeTransport:
    name = "fake"

    def __init__(
        self, agent_name: str, layers: list[torch.Tensor], layout: KVLayout, fabric: FakeFabric
    ) -> None:
        """Joins `fabric` as `agent_name`; ValueError when `layers` do not fit `layout`."""
        self.num_blocks = check_cache(layers, layout)
        self.layout = layout
        self.agent_name = agent_name
        self.layers = layers
        self.fabric = fabric
        self.peers: dict[str, int] = {}  # connected agent → its block count
        fabric.transports[agent_name] = self

    def metadata(self) -> bytes:
        return self.agent_name.encode()

    def connect(self, peer: str, metadata: bytes, num_blocks: int) -> None:
        """ValueError for metadata that is not `peer`'s, or another layout or block count."""
        remote = self.fabric.transports.get(peer)
        if metadata != peer.encode() or remote is None:
            raise ValueError(f"no fake agent {peer!r} with that metadata")
        if remote.layout != self.layout:
            raise ValueError(f"peer {peer!r} has layout {remote.layout}, this one {self.layout}")
        if num_blocks != remote.num_blocks:
            raise ValueError(f"peer {peer!r} holds {remote.num_blocks} blocks, not {num_blocks}")
        self.peers[peer] = num_blocks

    def start_read(
        self, peer: str, remote_blocks: list[int], local_blocks: list[int]
    ) -> FakeReadHandle:
        if peer not in self.peers:
            raise ValueError(f"unknown peer {peer!r}: connect first")
        check_read(remote_blocks, local_blocks, self.peers[peer], self.num_blocks)
        return FakeReadHandle(self.fabric, self, peer, list(remote_blocks), list(local_blocks))

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        yield  # nothing to progress in one process

    def close(self) -> None:
        if self.fabric.transports.get(self.agent_name) is self:
            self.fabric.remove(self.agent_name)
        self.peers.clear()
