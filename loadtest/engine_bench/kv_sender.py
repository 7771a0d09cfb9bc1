"""The prefill side of `splitserve bench kv`, in its own process: a seeded cache registered
with NIXL (the receiver READs it) and, on command, a `nats` push as the prefill worker does
it (gather the blocks, `to_chunks` under max_payload, a window of request/replies, KVDone).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import fields

import torch

from services.worker.config import WorkerConfig
from shared.bus import Bus
from shared.engine.kv_handoff import KVBlocks
from shared.kvtransfer.chunks import DTYPES, KVLayout, to_chunks
from shared.kvtransfer.nats_transport import ChunkSender
from shared.kvtransfer.nixl_transport import NixlTransport
from shared.protocol import KVDone

SEED = 1234
SUBJECT = "bench.kv"
AGENT = "bench-prefill"
WORKER_DEFAULTS = {f.name: f.default for f in fields(WorkerConfig)}


def seeded_cache(layout: KVLayout, num_blocks: int, seed: int | None) -> list[torch.Tensor]:
    """[num_blocks, block_size, 2, kv_heads, head_dim] per layer: seeded random, or zeros."""
    shape = [num_blocks, *layout.block_shape]
    dtype = DTYPES[layout.dtype]
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(layout.num_layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layout.num_layers)]


def serve_prefill_side(
    layout_fields: list,
    num_blocks: int,
    nats_url: str,
    with_nixl: bool,
    commands: mp.Queue,
    results: mp.Queue,
) -> None:
    """Puts the NIXL metadata (None without NIXL), then answers each ("nats", n) command
    with the seconds a push of blocks 0..n-1 took; None stops it."""
    layout = KVLayout(*layout_fields)
    cache = seeded_cache(layout, num_blocks, SEED)
    transport = NixlTransport(AGENT, cache, layout) if with_nixl else None
    results.put(transport.metadata() if transport else None)
    asyncio.run(serve_commands(cache, nats_url, commands, results))
    if transport:
        transport.close()


async def serve_commands(
    cache: list[torch.Tensor], nats_url: str, commands: mp.Queue, results: mp.Queue
) -> None:
    bus = await Bus.connect(nats_url, "bench-kv-prefill")
    while (command := await asyncio.to_thread(commands.get)) is not None:
        _, n = command
        results.put(await push(bus, cache, n))
    await bus.close()


async def push(bus: Bus, cache: list[torch.Tensor], n: int) -> float:
    """Seconds from the gather to KVDone's ack (every chunk written by the receiver)."""
    start = time.perf_counter()
    deadline = asyncio.get_running_loop().time() + 120
    sender = ChunkSender(bus, SUBJECT, WORKER_DEFAULTS["kv_window"], deadline)
    index = torch.arange(n)
    data = torch.stack([layer.index_select(0, index) for layer in cache])  # as read_blocks
    blocks = KVBlocks("bench", 0, len(cache), 0, [None] * n, data)
    for chunk in to_chunks(blocks, bus.max_payload - WORKER_DEFAULTS["kv_headroom"]):
        await sender.send(chunk)
    await sender.finish(KVDone("bench", sender.num_chunks, 0))
    return time.perf_counter() - start
