"""What the scheduler knows of a worker's costs (`WorkerCosts`, each pair's `Link`) and how
its heartbeat gives them; the cost model that uses them is path_cost.py.

The one subtle rule: a link's bandwidth is measured on whole transfers, which include the
link's fixed cost; once small transfers have measured that cost (`KVPeer.latency`) it is
taken out of the mean transfer before its bytes are divided, so it is not counted twice.
A pair with no transfer yet has no link (path_cost borrows the mesh's typical one).
A block in a worker's second KV tier is worth `tier_weight` of one in its pool, and a block
it would READ from another worker's pool `peer_weight` (with --kv-peer-reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.protocol import Heartbeat, KVPeer


@dataclass(frozen=True, slots=True)
class Link:
    """A (prefill, decode) pair's measured KV transfer: seconds = latency + bytes × per_byte."""

    per_byte: float  # seconds
    latency: float  # seconds: the fixed cost of a transfer


@dataclass(frozen=True, slots=True)
class WorkerCosts:
    """One worker's measurements as the registry last heard them (0: not measured)."""

    prefill_rate: float = 0.0  # prompt tokens per second of step time
    decode_step_s: float = 0.0  # seconds per decode step
    queued_tokens: int = 0  # prompt tokens it has yet to compute (placed ones included)
    streams: int = 0  # requests decoding on it
    stall_s: float = 0.0  # recent seconds its streams waited on prompt work (decayed)
    stream_tokens: int = 0  # the fewest max_tokens among its running streams (0: none)
    block_bytes: int = 0  # one KV block, every layer
    links: Mapping[str, Link] = field(default_factory=dict)  # prefill side: decode id → link


def link_of(peer: KVPeer) -> Link | None:
    if not peer.transfers or peer.mean_seconds <= 0:
        return None
    latency = min(peer.latency, peer.mean_seconds)
    if peer.mean_bytes <= 0:  # only empty transfers so far: all fixed cost
        return Link(0.0, peer.mean_seconds)
    return Link((peer.mean_seconds - latency) / peer.mean_bytes, latency)


def links_of(beat: Heartbeat) -> dict[str, Link]:
    links = {}
    for peer in beat.kv_peers:
        link = link_of(peer)
        if link is not None:
            links[peer.worker_id] = link
    return links


UNMEASURED_TIER_WEIGHT = 0.5  # a tier block's worth before its loads are measured


def tier_weight(beat: Heartbeat) -> float:
    """What a block in the worker's second KV tier is worth to a prompt against one in its
    pool (1): the share of the block's recompute time that loading it saves (0: no tier, or
    loading costs more, so the worker recomputes it)."""
    tier = beat.kv_tier
    if tier.capacity_bytes == 0:
        return 0.0
    if tier.hits == 0 or beat.prefill_rate <= 0 or beat.block_size <= 0:
        return UNMEASURED_TIER_WEIGHT
    recompute_s = beat.block_size / beat.prefill_rate
    return max(0.0, 1.0 - (tier.load_seconds / tier.hits) / recompute_s)


UNMEASURED_PEER_WEIGHT = 0.5  # a block read from a peer, before the worker's reads are measured


def peer_weight(beat: Heartbeat) -> float:
    """What a block the worker would READ from another worker's pool is worth to a prompt
    against one in its own pool (1): the share of its recompute time the read saves, by the
    worker's own measured reads (pin and READ, end to end; 0: reading costs more)."""
    reads = beat.kv_peer_reads
    if reads.blocks == 0 or beat.prefill_rate <= 0 or beat.block_size <= 0:
        return UNMEASURED_PEER_WEIGHT
    recompute_s = beat.block_size / beat.prefill_rate
    return max(0.0, 1.0 - (reads.seconds / reads.blocks) / recompute_s)


def worker_costs(
    beat: Heartbeat, links: dict[str, Link], placed: int, placed_tokens: int
) -> WorkerCosts:
    """`placed` requests and `placed_tokens` prompt tokens were placed on it since `beat`."""
    return WorkerCosts(
        prefill_rate=beat.prefill_rate,
        decode_step_s=beat.decode_step_s,
        queued_tokens=beat.queued_prompt_tokens + placed_tokens,
        streams=beat.num_running + placed,
        stall_s=beat.stall_s,
        stream_tokens=beat.stream_tokens,
        block_bytes=beat.block_bytes,
        links=links,
    )
