"""The open-loop runner (`vllm bench serve`): requests arrive on a schedule, not on replies.

Each request is launched at its arrival time; `max_concurrency` then caps how many are in
flight (a request over the cap waits, and its clock starts when it is actually sent).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import aiohttp

from loadtest.arrivals import send_offsets
from loadtest.client import ClientConfig, send_request
from loadtest.progress import Progress
from loadtest.request import BenchRequest, RequestRecord


@dataclass(slots=True, frozen=True)
class OpenLoopConfig:
    request_rate: float = math.inf  # requests per second; inf = all at once
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    max_concurrency: int | None = None
    seed: int = 0
    show_progress: bool = True


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    start: float  # perf_counter at the first send
    duration: float  # seconds from the start to the last reply's end


async def run_open_loop(
    client: ClientConfig, cfg: OpenLoopConfig, requests: list[BenchRequest], label: str = ""
) -> RunResult:
    offsets = send_offsets(requests, cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)
    progress = Progress(len(requests), label) if cfg.show_progress else None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with limit:
                record = await send_request(session, client, req)
            if progress:
                progress.update(record.ok)
            return record

        records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    if progress:
        progress.close()
    end = max((r.end for r in records), default=start)
    return RunResult(list(records), start, end - start)
