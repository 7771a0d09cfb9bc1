"""`splitserve bench burst --mesh`: the burst through `splitserve up`, and what the decode
steps that start beside it cost its last first token.

Each pair sends the burst twice, one after the other: wanting one token a prompt (the
prefill worker alone: nothing is left to decode) and wanting `output_len` tokens (the decode
worker starts on the first streams while later prompts are still being prefilled). The gap
between the two last first tokens is what those decode steps cost the burst on a machine
whose workers share the cores; pairs alternate, so a host whose speed drifts shows in both
halves of each pair. Prompts are random token ids, fresh for every burst, so no prefix is
cached and the engine-alone `bench burst` computes the same work.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loadtest.client import ClientConfig, send_request
from loadtest.mesh import MeshProcess
from loadtest.outputs import discover_model
from loadtest.request import BenchRequest, RequestRecord
from shared.engine.model_config import ModelConfig
from shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class MeshBurstConfig:
    model_dir: Path
    prompts: int = 16
    prompt_len: int = 100
    output_len: int = 128  # the second burst of a pair; the first wants 1 token
    pairs: int = 5
    up_args: tuple[str, ...] = ()
    log: Path = Path("artifacts/bench/burst-mesh.log")

    def __post_init__(self) -> None:
        if min(self.prompts, self.prompt_len, self.pairs) < 1 or self.output_len < 2:
            raise ConfigError("prompts, prompt_len and pairs must be positive, output_len > 1")


@dataclass(frozen=True, slots=True)
class MeshBurstPair:
    alone_ms: float  # the last first token, every request wanting one token
    streaming_ms: float  # the same, every request wanting output_len

    @property
    def gap_ms(self) -> float:
        return self.streaming_ms - self.alone_ms


def last_first_token_ms(records: list[RequestRecord]) -> float:
    """The latest TTFT of a burst sent at once; a failed request fails the bench."""
    failed = [r for r in records if r.error or not r.chunk_times]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) of the burst failed: {failed[0].error}")
    return max((r.chunk_times[0] - r.send) * 1e3 for r in records)


async def _send_burst(
    session: aiohttp.ClientSession, client: ClientConfig, requests: list[BenchRequest]
) -> float:
    records = await asyncio.gather(*(send_request(session, client, r) for r in requests))
    return last_first_token_ms(records)


async def run_pairs(config: MeshBurstConfig, url: str, model: str) -> list[MeshBurstPair]:
    rng = random.Random(0)
    vocab = ModelConfig.from_dir(config.model_dir).vocab_size
    client = ClientConfig(url, model)

    def burst(output_len: int) -> list[BenchRequest]:
        ids = [
            [rng.randrange(vocab) for _ in range(config.prompt_len)] for _ in range(config.prompts)
        ]
        return [BenchRequest(p, config.prompt_len, output_len, label="burst") for p in ids]

    pairs = []
    async with aiohttp.ClientSession() as session:
        await _send_burst(session, client, burst(2))  # warm-up: every hop once
        for pair in range(config.pairs):
            alone = await _send_burst(session, client, burst(1))
            streaming = await _send_burst(session, client, burst(config.output_len))
            pairs.append(MeshBurstPair(alone, streaming))
            print(
                f"pair {pair + 1}: last first token {alone:.0f} ms wanting 1 token, "
                f"{streaming:.0f} ms wanting {config.output_len} (gap {streaming - alone:+.0f})",
                flush=True,
            )
    return pairs


def run_mesh_burst_bench(config: MeshBurstConfig) -> list[MeshBurstPair]:
    mesh = MeshProcess(config.model_dir, list(config.up_args), config.log)
    started = time.monotonic()
    try:
        mesh.wait_ready()
        print(f"mesh ready in {time.monotonic() - started:.0f} s", flush=True)
        pairs = asyncio.run(run_pairs(config, mesh.url, discover_model(mesh.url)))
    finally:
        mesh.stop()
    alone = statistics.median(p.alone_ms for p in pairs)
    streaming = statistics.median(p.streaming_ms for p in pairs)
    gap = statistics.median(p.gap_ms for p in pairs)
    up = " ".join(("splitserve up", *config.up_args))
    print(
        f"{config.prompts} x {config.prompt_len} tokens through `{up}`, medians of "
        f"{len(pairs)} pairs: last first token "
        f"{alone:.0f} ms wanting 1 token, {streaming:.0f} ms wanting {config.output_len}; "
        f"the decode steps cost the burst {gap:+.0f} ms"
    )
    return pairs
