"""The KV hand-off's messages, prefill → decode (DESIGN.md section 4): chunks of KV pushed
over NATS (`KVChunk`, then `KVDone`), or the blocks offered for a one-sided READ (`KVReady`).
shared/protocol.py re-exports them with every other message.

The one subtle rule: every one of them names both processes' epochs (shared/epoch.py), and
the receiver refuses a message meant for another process of itself (kvtransfer/fence.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.outcome import Outcome


@dataclass(slots=True)
class KVChunk:
    request_id: str
    chunk_index: int
    layer_start: int
    layer_end: int  # exclusive
    first_block: int  # index in the request's block table
    block_hashes: list[int | None]
    dtype: str  # "float32" | "bfloat16" | "float16"
    shape: list[int]  # [layers, blocks, block_size, 2, kv_heads, head_dim]
    data: bytes
    epoch: int = 0  # the sending process's (shared/epoch.py; 0: not said)
    to_epoch: int = 0  # the receiving process's, from its reservation: another refuses it


@dataclass(slots=True)
class KVDone:
    request_id: str
    num_chunks: int
    first_token_id: int  # the token the prefill worker sampled and already streamed
    outcome: Outcome = Outcome.OK  # anything else: the transfer is off, drop the reservation
    error: str = ""
    epoch: int = 0  # as KVChunk's
    to_epoch: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK


@dataclass(slots=True)
class KVReady:
    """The one-sided transports (`nixl`): the prefill worker's blocks are ready to be READ.
    The decode worker checks every field, READs them into its reservation, then answers
    (a `TaskAck`); the prefill worker keeps them until that answer or its own deadline."""

    request_id: str
    transport: str  # "nixl"
    agent: str  # the prefill worker's agent name
    agent_metadata: bytes  # what the decode worker needs to connect to it
    num_cache_blocks: int  # blocks in the prefill worker's cache: every id is below
    layout: list[int]  # [num_layers, block_size, 2, kv_heads, head_dim]
    dtype: str  # "float32" | "bfloat16" | "float16"
    first_block: int  # index in the request's block table of block_ids[0]
    block_ids: list[int]  # in the prefill worker's cache, in table order
    block_hashes: list[int | None]  # chained prefix hash of each; None: partly filled
    first_token_id: int  # the token the prefill worker sampled and already streamed
    read_by: float  # Unix seconds: the READ must be over (done or failed) by then
    # The prefill engine's own hand-off parameters, opaque to the mesh: for vLLM workers its
    # `kv_transfer_params` (JSON), with which the decode engine READs; b"" for ours.
    engine_params: bytes = b""
    epoch: int = 0  # the offering process's: an older one of the same agent is refused
    to_epoch: int = 0  # the receiving process's, from its reservation: another refuses it
