"""The path of one request, chosen by predicted cost (pure: no I/O, no clock).

Two paths serve a request on a decode worker D:
- split: a prefill worker P computes the prompt and streams the first token, then its KV
  moves to D. Predicted TTFT = a reservation round trip + P's queued prompt tokens / P's
  rate + the tokens uncached on P / P's rate. Its cost adds the transfer (the link's fixed
  cost + the bytes D lacks × the link's seconds per byte): the first token leaves before
  the KV, so the transfer is not in the TTFT, but D's second token waits for it.
- local: D prefills the prompt itself. Predicted TTFT = (D's queued prompt tokens + the
  tokens uncached on D) / D's rate, plus one decode step when D has streams running (the
  step in progress). Its cost adds what the prefill inflicts on D's running streams: each
  stalls for the prefill's duration, weighed by `stall_weight` (seconds of one request's
  TTFT that one second of one stream's stall is worth), so a decode worker full of streams
  prefers the split.
The cheaper path wins (a tie stays local); split offers are tried cheapest first. With
objectives (`--path-choice slo`), the path that keeps them wins first (path_slo.py).

The one subtle rule: a prediction needs measurements, and a mesh that has none yet (a cold
mesh, or a pair never used) falls back to the fixed rule it had before measuring: local when
at most `local_prefill_tokens` tokens are uncached on D (or no prefill worker exists), else
split, prefill workers in their ranked order. A worker not measured yet borrows the typical
(median) rate of its mesh, a pair never used the typical link, so one measured pair is enough.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from services.scheduler.measures import Link, WorkerCosts
from services.scheduler.path_slo import Objectives, prefer_local, streams_tpot
from services.scheduler.routing import blocks_for, prefills_locally


class Path(IntEnum):
    SPLIT = 0  # prefill worker + KV transfer
    LOCAL = 1  # the decode worker prefills itself

    @property
    def label(self) -> str:  # as the placements metric names them
        return "disaggregated" if self is Path.SPLIT else "decode_only"


class Rule(IntEnum):
    COST = 0  # both paths predicted: the cheaper one
    COLD = 1  # not enough measured: the fixed rule (`local_prefill_tokens`)
    NO_PREFILL = 2  # no prefill worker to split with: local
    FAILED_HAND_OFF = 3  # an earlier attempt's KV never arrived: local (hand_offs.py)
    FAILED_PAIR = 4  # a hand-off over every pair to this decode worker failed lately: local


@dataclass(frozen=True, slots=True)
class Offer:
    """A worker that could take the request, with what routing found of its cache."""

    worker_id: str
    overlap: int  # leading prompt blocks it holds
    costs: WorkerCosts


@dataclass(frozen=True, slots=True)
class CostParams:
    block_size: int
    local_prefill_tokens: int  # the cold rule
    stall_weight: float
    reserve_rtt: float  # seconds: the scheduler's Reserve round trip (measured; 0 unknown)
    fixed: bool = False  # --path-choice fixed: the cold rule always
    objectives: Objectives = field(default_factory=Objectives)  # --path-choice slo: path_slo.py


@dataclass(frozen=True, slots=True)
class Typical:
    """Stand-ins for what a worker or pair has not measured yet: the mesh's medians."""

    rate: float = 0.0
    link: Link | None = None

    @classmethod
    def of(cls, workers: Sequence[WorkerCosts]) -> Typical:
        rates = [w.prefill_rate for w in workers if w.prefill_rate > 0]
        links = [link for w in workers for link in w.links.values()]
        link = None
        if links:
            per_byte = statistics.median(k.per_byte for k in links)
            link = Link(per_byte, statistics.median(k.latency for k in links))
        return cls(statistics.median(rates) if rates else 0.0, link)


@dataclass(frozen=True, slots=True)
class Choice:
    path: Path
    rule: Rule
    predicted_ttft: float  # of the local path, or of the first split offer; 0: no prediction
    # split: (prefill worker id, its predicted TTFT; 0: none) in the order to try them
    prefills: tuple[tuple[str, float], ...] = ()


class SplitOffer(NamedTuple):
    worker_id: str
    ttft: float  # predicted; 0: its rate is unknown
    cost: float | None  # TTFT + transfer; None: not predictable (no rate or no link)


def uncached_tokens(num_tokens: int, overlap: int, block_size: int) -> int:
    """Tokens a worker holding `overlap` leading blocks computes (at least the last one)."""
    return max(1, num_tokens - overlap * block_size)


def local_ttft(num_tokens: int, decode: Offer, rate: float, block_size: int) -> float:
    costs = decode.costs
    work = costs.queued_tokens + uncached_tokens(num_tokens, decode.overlap, block_size)
    return work / rate + (costs.decode_step_s if costs.streams else 0.0)


def local_prefill_s(num_tokens: int, decode: Offer, rate: float, block_size: int) -> float:
    """Seconds the decode worker's streams wait while it prefills the prompt itself."""
    return uncached_tokens(num_tokens, decode.overlap, block_size) / rate


def stall_cost(num_tokens: int, decode: Offer, rate: float, params: CostParams) -> float:
    """Running streams × the seconds this prompt's prefill holds them, weighed."""
    prefill_s = local_prefill_s(num_tokens, decode, rate, params.block_size)
    return params.stall_weight * decode.costs.streams * prefill_s


def split_ttft(num_tokens: int, prefill: Offer, rate: float, params: CostParams) -> float:
    work = prefill.costs.queued_tokens + uncached_tokens(
        num_tokens, prefill.overlap, params.block_size
    )
    return params.reserve_rtt + work / rate


def transfer_s(
    num_tokens: int, decode: Offer, link: Link, block_bytes: int, block_size: int
) -> float:
    """The blocks the decode worker lacks, over the pair's link."""
    blocks = max(0, blocks_for(num_tokens, block_size) - decode.overlap)
    return link.latency + blocks * block_bytes * link.per_byte


def choose(
    num_tokens: int,
    decode: Offer,
    prefills: Sequence[Offer],
    typical: Typical,
    params: CostParams,
) -> Choice:
    """The path for a request of `num_tokens` (prompt + delivered) on `decode`; `prefills`
    in routing's ranked order."""
    local_rate = decode.costs.prefill_rate or typical.rate
    local = local_ttft(num_tokens, decode, local_rate, params.block_size) if local_rate else 0.0
    if not prefills:
        return Choice(Path.LOCAL, Rule.NO_PREFILL, local)
    splits = [_split(num_tokens, decode, p, typical, params) for p in prefills]
    priced = sorted((s for s in splits if s.cost is not None), key=lambda s: s.cost or 0.0)
    if local_rate and priced and not params.fixed:
        local_cost = local + stall_cost(num_tokens, decode, local_rate, params)
        best = priced[0]
        local_wins = best.cost is None or local_cost <= best.cost
        if params.objectives:
            costs = decode.costs
            prefill_s = local_prefill_s(num_tokens, decode, local_rate, params.block_size)
            tokens = params.objectives.stream_tokens
            if costs.stream_tokens:
                tokens = min(tokens, costs.stream_tokens) if tokens else costs.stream_tokens
            tpot = streams_tpot(costs.decode_step_s, costs.stall_s, prefill_s, tokens)
            local_wins = prefer_local(
                params.objectives, local, best.ttft, costs.streams, tpot, local_wins
            )
        if local_wins:
            return Choice(Path.LOCAL, Rule.COST, local)
        order = priced + [s for s in splits if s.cost is None]
        return Choice(Path.SPLIT, Rule.COST, best.ttft, tuple((s.worker_id, s.ttft) for s in order))
    if prefills_locally(
        num_tokens,
        decode.overlap,
        params.block_size,
        params.local_prefill_tokens,
        have_prefill_workers=True,
    ):
        return Choice(Path.LOCAL, Rule.COLD, local)
    in_rank = tuple((s.worker_id, s.ttft) for s in splits)
    return Choice(Path.SPLIT, Rule.COLD, splits[0].ttft, in_rank)


def _split(
    num_tokens: int, decode: Offer, prefill: Offer, typical: Typical, params: CostParams
) -> SplitOffer:
    rate = prefill.costs.prefill_rate or typical.rate
    if not rate:
        return SplitOffer(prefill.worker_id, 0.0, None)
    ttft = split_ttft(num_tokens, prefill, rate, params)
    link = prefill.costs.links.get(decode.worker_id) or typical.link
    block_bytes = prefill.costs.block_bytes or decode.costs.block_bytes
    if link is None or not block_bytes:
        return SplitOffer(prefill.worker_id, ttft, None)
    transfer = transfer_s(num_tokens, decode, link, block_bytes, params.block_size)
    return SplitOffer(prefill.worker_id, ttft, ttft + transfer)
