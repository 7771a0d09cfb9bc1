"""`splitserve bench isolation`: what a burst of long prompts costs the streams already
running, per configuration of pinned pools (the same `--configs` as `bench slo`).

A round starts `streams` streams (short prompts, `stream_len` tokens each, sent together),
lets them settle, then sends a burst of `burst` long prompts (`long_len` tokens) that want one
token each: the burst is pure prefill, so whatever it does to the running streams is
interference, not a bigger decode batch. The streams' inter-token gaps are read in two
windows: **quiet**, the `quiet_s` seconds before the burst, and **burst**, from the burst's
send to its last first token. The figure is burst ITL p99 / quiet ITL p99 (the issue's
isolation target: ≤ 1.3 for the split configuration); rounds alternate nothing, each is a
fresh set of prompts, and the medians over rounds are reported.

The one subtle rule: a gap belongs to the window its later chunk falls in, and a round whose
streams had not all started before the quiet window, or ended before the burst did, is
refused (raise `--settle` or `--stream-len`): its windows would measure something else.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import aiohttp

from loadtest.client import ClientConfig, send_request
from loadtest.datasets import LOW_TOKEN_ID
from loadtest.metrics import Stats
from loadtest.request import BenchRequest, RequestRecord
from loadtest.slo.config import Configuration
from loadtest.slo.sweep import Servers, serving


@dataclass(frozen=True, slots=True)
class IsolationConfig:
    configs: tuple[Configuration, ...]
    streams: int = 4  # running before the burst
    stream_len: int = 512  # tokens each stream wants
    prompt_len: int = 32  # the streams' prompts
    burst: int = 2  # long prompts sent together
    long_len: int = 1024  # tokens each
    settle_s: float = 2.0  # after the streams' send, before the quiet window
    quiet_s: float = 3.0
    rounds: int = 3
    seed: int = 0
    timeout_s: float = 300.0


class RoundRefused(RuntimeError):
    """The round's windows do not hold what they should (see the module's subtle rule)."""


@dataclass(frozen=True, slots=True)
class Round:
    quiet_p50_ms: float
    quiet_p99_ms: float
    burst_p50_ms: float
    burst_p99_ms: float
    burst_s: float  # the burst's send to its last first token

    @property
    def ratio(self) -> float:
        return self.burst_p99_ms / self.quiet_p99_ms


@dataclass(frozen=True, slots=True)
class RowResult:
    configuration: str
    rounds: list[Round]

    def median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.rounds)

    def median_ratio(self) -> float:
        """The median over rounds of each round's burst/quiet ITL p99."""
        return statistics.median(r.ratio for r in self.rounds)

    def as_json(self) -> dict[str, object]:
        rounds = [asdict(r) | {"ratio": r.ratio} for r in self.rounds]
        return {"configuration": self.configuration, "rounds": rounds}


def gaps_in(records: list[RequestRecord], start: float, end: float) -> list[float]:
    """Inter-chunk gaps of `records` whose later chunk falls in [start, end), in seconds."""
    return [
        later - earlier
        for r in records
        for earlier, later in zip(r.chunk_times, r.chunk_times[1:], strict=False)
        if start <= later < end
    ]


def judge(
    streams: list[RequestRecord], burst: list[RequestRecord], sent: float, quiet_s: float
) -> Round:
    """One round's figures from its records; `sent` is the burst's send time."""
    if failed := [r for r in streams + burst if not r.ok]:
        raise RoundRefused(
            f"{len(failed)} requests failed: {failed[0].error} {failed[0].error_detail}"
        )
    quiet_from = sent - quiet_s
    if any(r.chunk_times[0] >= quiet_from for r in streams):
        raise RoundRefused("a stream had not started before the quiet window: raise --settle")
    burst_end = max(r.chunk_times[0] for r in burst)
    if any(r.chunk_times[-1] < burst_end for r in streams):
        raise RoundRefused("a stream ended before the burst did: raise --stream-len")
    quiet, loud = gaps_in(streams, quiet_from, sent), gaps_in(streams, sent, burst_end)
    if not quiet or not loud:
        raise RoundRefused("no inter-token gap in a window")
    quiet_ms, loud_ms = Stats.of(quiet), Stats.of(loud)
    return Round(
        quiet_p50_ms=quiet_ms.median,
        quiet_p99_ms=quiet_ms.p99,
        burst_p50_ms=loud_ms.median,
        burst_p99_ms=loud_ms.p99,
        burst_s=burst_end - sent,
    )


def _prompts(
    rng: random.Random, vocab: int, count: int, length: int, wants: int, label: str
) -> list[BenchRequest]:
    return [
        BenchRequest(
            [rng.randrange(LOW_TOKEN_ID, vocab) for _ in range(length)], length, wants, label=label
        )
        for _ in range(count)
    ]


async def one_round(client: ClientConfig, cfg: IsolationConfig, vocab: int, seed: int) -> Round:
    rng = random.Random(seed)
    streams = _prompts(rng, vocab, cfg.streams, cfg.prompt_len, cfg.stream_len, "stream")
    burst = _prompts(rng, vocab, cfg.burst, cfg.long_len, 1, "burst")
    async with aiohttp.ClientSession() as session:
        running = [asyncio.create_task(send_request(session, client, r)) for r in streams]
        await asyncio.sleep(cfg.settle_s + cfg.quiet_s)
        burst_records = await asyncio.gather(*(send_request(session, client, r) for r in burst))
        stream_records = await asyncio.gather(*running)
    sent = min(r.send for r in burst_records)
    return judge(list(stream_records), list(burst_records), sent, cfg.quiet_s)


async def warm_up(client: ClientConfig, cfg: IsolationConfig, vocab: int) -> None:
    """A short stream and a long prompt first, so the first round meets no cold start."""
    rng = random.Random("warm-up")
    requests = _prompts(rng, vocab, 1, cfg.prompt_len, 16, "warm-up")
    requests += _prompts(rng, vocab, 1, cfg.long_len, 1, "warm-up")
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(send_request(session, client, r) for r in requests))


async def run_isolation(
    cfg: IsolationConfig, servers: Servers, vocab: int, say: Callable[[str], None] = print
) -> list[RowResult]:
    results = []
    for row in cfg.configs:
        say(f"{row.name}: starting {row.server}")
        async with serving(servers, row, cfg.timeout_s) as client:
            await warm_up(client, cfg, vocab)
            rounds = []
            for i in range(cfg.rounds):
                rounds.append(await one_round(client, cfg, vocab, seed=cfg.seed * 1000 + i))
                r = rounds[-1]
                say(
                    f"{row.name} round {i + 1}: ITL p99 quiet {r.quiet_p99_ms:.1f} ms, burst "
                    f"{r.burst_p99_ms:.1f} ms (x{r.ratio:.2f}); p50 {r.quiet_p50_ms:.1f} → "
                    f"{r.burst_p50_ms:.1f} ms; burst prefilled in {r.burst_s:.2f} s"
                )
        results.append(RowResult(row.name, rounds))
    return results
