"""`splitserve bench kv --mesh`: what the KV hand-off costs a client, per transport.

For each transport a fresh `splitserve up --kv-transport T` (1 prefill + 1 decode) serves
long prompts one at a time (random tokens, so no prefix is cached): the gap between the
first token (sampled by the prefill worker) and the second (the first one the decode worker
computes after the KV arrived) against the steady gap between later tokens. The target:
that first gap within 2x the steady one.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from loadtest.client import ClientConfig
from loadtest.datasets import DatasetConfig, load_dataset
from loadtest.mesh import MeshProcess
from loadtest.openloop import OpenLoopConfig, run_open_loop


@dataclass(frozen=True, slots=True)
class KVMeshBenchConfig:
    model_dir: Path
    model: str
    vocab_size: int
    transports: tuple[str, ...] = ("nixl", "nats")
    prompt_len: int = 2048
    output_len: int = 32
    num_prompts: int = 4
    out: Path = Path("artifacts/bench")


@dataclass(frozen=True, slots=True)
class HandOffGap:
    transport: str
    first_gap_ms: float  # median over the prompts: second token − first token
    steady_gap_ms: float  # median of the later gaps
    ttft_ms: float  # median

    @property
    def ratio(self) -> float:
        return self.first_gap_ms / self.steady_gap_ms


def measure(cfg: KVMeshBenchConfig, transport: str) -> HandOffGap:
    mesh = MeshProcess(
        cfg.model_dir,
        # the fixed rule: every long prompt splits (measured costs would keep an idle
        # mesh's prompts where they decode, and there would be no hand-off to time)
        ["--kv-transport", transport, "--path-choice", "fixed"],
        cfg.out / f"kv-mesh-{transport}.log",
    )
    try:
        mesh.wait_ready()
        client = ClientConfig(mesh.url, cfg.model)
        one_at_a_time = OpenLoopConfig(max_concurrency=1, show_progress=False)
        warmup = DatasetConfig("random", 1, cfg.prompt_len, 4, cfg.vocab_size, seed=99)
        asyncio.run(run_open_loop(client, one_at_a_time, load_dataset(warmup)))
        prompts = DatasetConfig(
            "random", cfg.num_prompts, cfg.prompt_len, cfg.output_len, cfg.vocab_size, seed=1
        )
        run = asyncio.run(run_open_loop(client, one_at_a_time, load_dataset(prompts), transport))
    finally:
        mesh.stop()
    records = [r for r in run.records if r.ok and len(r.chunk_times) > 2]
    if not records:
        raise RuntimeError(f"no request completed over {transport}; see {mesh.log_path}")
    gaps = [[b - a for a, b in pairwise(r.chunk_times)] for r in records]
    return HandOffGap(
        transport,
        1e3 * statistics.median(g[0] for g in gaps),
        1e3 * statistics.median(x for g in gaps for x in g[1:]),
        1e3 * statistics.median(r.ttft for r in records),
    )


def run_kv_mesh_bench(cfg: KVMeshBenchConfig) -> list[HandOffGap]:
    rows = [measure(cfg, transport) for transport in cfg.transports]
    print(f"splitserve up, {cfg.prompt_len}-token prompts one at a time → {cfg.output_len} tokens")
    print(f"{'transport':10} {'TTFT ms':>9} {'1st→2nd ms':>11} {'later gaps ms':>14} {'ratio':>6}")
    for row in rows:
        print(
            f"{row.transport:10} {row.ttft_ms:9.1f} {row.first_gap_ms:11.1f} "
            f"{row.steady_gap_ms:14.1f} {row.ratio:6.2f}"
        )
    return rows
