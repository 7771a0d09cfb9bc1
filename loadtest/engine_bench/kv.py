"""`splitserve bench kv`: GB/s of moving KV blocks between two processes, per transport.

A spawned child plays the prefill worker (it holds a seeded cache of the default model's
layout: SmolLM2-135M, 30 layers × [16, 2, 3, 64], 737,280 B per block in float32); this
process plays the decode worker and receives blocks 0..n-1 into its own blocks 0..n-1:
- `nixl`: one READ posted by the receiver (one descriptor per layer: the ids are a run);
- `nats`: today's path as the workers run it: the sender gathers the blocks, cuts them with
  `to_chunks` under max_payload and sends each as a request/reply (window 4) to a real
  nats-server; the receiver checks each with `from_chunk` and writes it into its cache;
- `copy`: the same bytes copied tensor to tensor in one process, for reference.
Every received block is checked against the sender's; the figure is the median of
`repeats`. The table goes to stdout and artifacts/bench/kv.json.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

import torch

from loadtest.engine_bench.kv_sender import AGENT, SEED, SUBJECT, seeded_cache, serve_prefill_side
from shared.bus import Bus, Headers
from shared.kvtransfer.chunks import KVLayout, from_chunk
from shared.kvtransfer.nats_transport import serve_kv
from shared.kvtransfer.nixl_transport import NixlTransport, nixl_available
from shared.kvtransfer.transfer import TransferState
from shared.nats_server import start_nats_server
from shared.protocol import KVChunk, KVDone, KVReady


@dataclass(slots=True, frozen=True)
class KVBenchConfig:
    blocks: tuple[int, ...] = (1, 8, 64, 512)
    dtype: str = "float32"
    repeats: int = 3
    # SmolLM2-135M-Instruct's KV layout
    num_layers: int = 30
    block_size: int = 16
    num_kv_heads: int = 3
    head_dim: int = 64
    out: Path = Path("artifacts/bench/kv.json")

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )


@dataclass(slots=True)
class KVBenchRow:
    blocks: int
    megabytes: float
    ms: dict[str, float]  # transport → median milliseconds
    gb_s: dict[str, float]  # transport → GB/s (1e9 bytes)
    nixl_over_nats: float | None


def run_kv_bench(cfg: KVBenchConfig) -> list[KVBenchRow]:
    layout, most = cfg.layout, max(cfg.blocks)
    ok, why = nixl_available()
    print(
        f"layout {layout}, {layout.block_bytes * layout.num_layers:,} B per block"
        + ("" if ok else f"; nixl skipped: {why}")
    )
    reference = seeded_cache(layout, most, SEED)
    receiver = seeded_cache(layout, most, None)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats_server(Path(tmp))
        ctx = mp.get_context("spawn")
        commands, results = ctx.Queue(), ctx.Queue()
        child = ctx.Process(
            target=serve_prefill_side,
            args=(list(astuple(layout)), most, server.url, ok, commands, results),
            daemon=True,
        )
        child.start()
        try:
            metadata = results.get(timeout=120)
            times = asyncio.run(
                measure(cfg, reference, receiver, server.url, metadata, commands, results)
            )
        finally:
            commands.put(None)
            child.join(30)
            server.stop()
    rows = [summarize(layout, n, {t: times[t][n] for t in times}) for n in cfg.blocks]
    print_table(rows, list(times))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print(f"wrote {cfg.out}")
    return rows


async def measure(
    cfg: KVBenchConfig,
    reference: list[torch.Tensor],
    receiver: list[torch.Tensor],
    nats_url: str,
    metadata: bytes | None,
    commands: mp.Queue,
    results: mp.Queue,
) -> dict[str, dict[int, list[float]]]:
    """Seconds per repeat, by transport and block count; checks every received byte."""
    times: dict[str, dict[int, list[float]]] = {"copy": {}, "nats": {}}
    for n in cfg.blocks:
        times["copy"][n] = [time_copy(reference, receiver, n) for _ in range(cfg.repeats)]
    bus = await Bus.connect(nats_url, "bench-kv-decode")
    await serve_kv(bus, SUBJECT, ChunkWriter(cfg.layout, receiver))
    for n in cfg.blocks:
        times["nats"][n] = []
        for _ in range(cfg.repeats):
            clear(receiver, n)
            commands.put(("nats", n))
            times["nats"][n].append(await asyncio.to_thread(results.get, True, 120))
            check(reference, receiver, n, "nats")
    await bus.close()
    if metadata is not None:
        times["nixl"] = {n: time_nixl(cfg, reference, receiver, metadata, n) for n in cfg.blocks}
    return times


@dataclass(slots=True)
class ChunkWriter:
    """The decode side of the `nats` path: check each chunk, write it into the cache."""

    layout: KVLayout
    cache: list[torch.Tensor]

    async def on_chunk(self, chunk: KVChunk, headers: Headers) -> None:
        blocks = from_chunk(chunk, self.layout, self.cache[0].shape[0])
        first, count = blocks.first_block, blocks.data.shape[1]  # table index = block id here
        for i, layer in enumerate(blocks.layers):
            self.cache[layer][first : first + count].copy_(blocks.data[i])

    async def on_done(self, done: KVDone, headers: Headers) -> None:
        return None

    async def on_ready(self, ready: KVReady, headers: Headers) -> None:
        raise ValueError("this bench pushes chunks only")


def time_copy(reference: list[torch.Tensor], receiver: list[torch.Tensor], n: int) -> float:
    start = time.perf_counter()
    for src, dst in zip(reference, receiver, strict=True):
        dst[:n].copy_(src[:n])
    return time.perf_counter() - start


def time_nixl(
    cfg: KVBenchConfig,
    reference: list[torch.Tensor],
    receiver: list[torch.Tensor],
    metadata: bytes,
    n: int,
) -> list[float]:
    transport = NixlTransport(f"bench-decode-{n}", receiver, cfg.layout)
    transport.connect(AGENT, metadata, max(cfg.blocks))
    seconds = []
    try:
        for _ in range(cfg.repeats + 1):  # the first READ also sets up the endpoint: dropped
            clear(receiver, n)
            start = time.perf_counter()
            handle = transport.start_read(AGENT, list(range(n)), list(range(n)))
            while (state := handle.poll()) == TransferState.TRANSFERRING:
                pass
            seconds.append(time.perf_counter() - start)
            handle.release()
            if state != TransferState.SUCCESS:
                raise RuntimeError(f"nixl READ of {n} blocks failed: {handle.error}")
            check(reference, receiver, n, "nixl")
    finally:
        transport.close()
    return seconds[1:]


def clear(cache: list[torch.Tensor], n: int) -> None:
    for layer in cache:
        layer[:n].zero_()


def check(reference: list[torch.Tensor], receiver: list[torch.Tensor], n: int, what: str) -> None:
    for index, (src, dst) in enumerate(zip(reference, receiver, strict=True)):
        if not torch.equal(src[:n], dst[:n]):
            raise RuntimeError(f"{what}: layer {index} of {n} blocks arrived wrong")


def summarize(layout: KVLayout, n: int, seconds: dict[str, list[float]]) -> KVBenchRow:
    num_bytes = n * layout.block_bytes * layout.num_layers
    ms = {t: statistics.median(s) * 1e3 for t, s in seconds.items()}
    gb_s = {t: num_bytes / (m / 1e3) / 1e9 for t, m in ms.items()}
    ratio = gb_s["nixl"] / gb_s["nats"] if "nixl" in gb_s else None
    return KVBenchRow(n, num_bytes / 1e6, ms, gb_s, ratio)


def print_table(rows: list[KVBenchRow], transports: list[str]) -> None:
    head = "| blocks | MB | " + " | ".join(f"{t} ms | {t} GB/s" for t in transports)
    print(head + " | nixl/nats |")
    print("|---" * (2 + 2 * len(transports) + 1) + "|")
    for r in rows:
        cells = " | ".join(f"{r.ms[t]:.2f} | {r.gb_s[t]:.2f}" for t in transports)
        ratio = f"{r.nixl_over_nats:.1f}x" if r.nixl_over_nats else "-"
        print(f"| {r.blocks} | {r.megabytes:.1f} | {cells} | {ratio} |")
