"""A worker's heartbeat, built from its config, its context and the engine's counters: what
the scheduler places by, the planner plans by and /mesh shows (shared/protocol.py says
what each field means).

The one subtle rule: the telemetry's `take_*` lists are taken here, once per beat: a
first token or a finished stream's TPOT is reported in exactly one heartbeat.
"""

from __future__ import annotations

import time

from services.worker.config import WorkerConfig
from services.worker.context import WorkerContext
from services.worker.startup import StartupReport
from services.worker.telemetry import WorkerTelemetry
from services.worker.tier_metrics import tier_counters
from shared.engine.stats import EngineStats
from shared.prefix_messages import PeerReadCounters
from shared.protocol import Heartbeat, KVPeer


def worker_heartbeat(
    config: WorkerConfig,
    ctx: WorkerContext,
    stats: EngineStats,
    telemetry: WorkerTelemetry,
    *,
    num_requests: int,
    metrics_port: int,
    kv_peers: list[KVPeer],
    epoch: int,
    startup: StartupReport,
) -> Heartbeat:
    layout, costs, now = ctx.layout, stats.costs, time.time()
    return Heartbeat(
        worker_id=config.worker_id,
        role=config.role,
        model=config.model_name,
        engine=config.engine_kind,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        free_blocks=stats.free_blocks,
        total_blocks=stats.total_blocks,
        block_size=stats.block_size,
        draining=ctx.draining,
        num_requests=num_requests,
        kv_blocks_sent=ctx.kv_blocks_sent,
        kv_blocks_received=ctx.kv_blocks_received,
        prefix_queries=stats.prefix_queries,
        prefix_hits=stats.prefix_hits,
        spec_proposed_tokens=stats.spec_decode.proposed,
        spec_accepted_tokens=stats.spec_decode.accepted,
        spec_verify_steps=stats.spec_decode.verify_steps,
        metrics_port=metrics_port,
        kv_transports=ctx.link.names,
        kv_peers=kv_peers,
        prefill_rate=costs.prefill_rate,
        decode_step_s=costs.decode_step_s,
        stall_s=costs.stall_s,
        stream_tokens=stats.min_stream_tokens,
        decode_batch=costs.decode_batch,
        decode_row_s=costs.decode_row_s,
        queued_prompt_tokens=stats.queued_prompt_tokens,
        busy=telemetry.busy_share(stats, now),
        block_bytes=layout.block_bytes * layout.num_layers,
        first_tokens=telemetry.take_first_tokens(),
        stream_tpots=telemetry.take_stream_tpots(),
        next_role=ctx.next_role,
        adapters=list(stats.adapters),
        adapters_loaded=list(stats.adapters_loaded),
        adapter_swap_ins=stats.adapter_swap_ins,
        kv_tier=tier_counters(stats.tier),
        kv_peer_reads=ctx.peer_reads.snapshot() if ctx.peer_reads else PeerReadCounters(),
        epoch=epoch,
        startup=startup.wire(),
        ready_s=startup.ready_s,
        sleep_level=ctx.sleep_level,
        num_preemptions=stats.num_preemptions,
    )
