"""The figures of `splitserve bench peers`: the turn plan, per-run figures, medians, ratios.

Servers take turns in a fixed order, round after round (A B A B …), so that a machine
that slows down or speeds up during the run weighs on every server alike. Each turn runs
every concurrency; the headline figures are read at the lowest and highest concurrency,
their median over rounds is taken per server, and each peer's median is compared with ours
as ours / theirs (above 1 is better for tok/s, below 1 is better for latencies): our mesh
of native workers against every peer, our mesh of vLLM workers against vLLM's own server
(the same engine, so that ratio is what the mesh itself costs or gains).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from loadtest.metrics import Summary
from shared.errors import ConfigError

OURS = "splitserve"
OURS_VLLM = "splitserve-vllm"  # our mesh, its workers running vLLM (`up --engine vllm`)
SERVERS = (OURS, "vllm", "llama.cpp", OURS_VLLM)
COMPARED = {OURS: ("vllm", "llama.cpp"), OURS_VLLM: ("vllm",)}  # ours → the peers it faces


@dataclass(frozen=True, slots=True)
class Turn:
    round: int  # 1-based
    server: str


def plan_turns(servers: tuple[str, ...], rounds: int) -> list[Turn]:
    """Every server once per round, in the order given, for `rounds` rounds."""
    if rounds < 1:
        raise ConfigError("rounds must be at least 1")
    if not servers:
        raise ConfigError("no server to run")
    unknown = [s for s in servers if s not in SERVERS]
    if unknown:
        raise ConfigError(f"unknown server {unknown[0]!r}; choose from {', '.join(SERVERS)}")
    if len(set(servers)) != len(servers):
        raise ConfigError("a server is named twice")
    return [Turn(r, server) for r in range(1, rounds + 1) for server in servers]


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One server, one round, one concurrency."""

    server: str
    round: int
    concurrency: int
    completed: int
    failed: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    input_tokens: int = 0  # in all, as the server's usage counts them
    output_tokens: int = 0

    @classmethod
    def of(cls, turn: Turn, concurrency: int, summary: Summary) -> RunFigures:
        return cls(
            turn.server,
            turn.round,
            concurrency,
            summary.completed,
            summary.failed,
            summary.output_throughput,
            summary.ttft.median,
            summary.ttft.p99,
            summary.tpot.median,
            summary.total_input_tokens,
            summary.total_output_tokens,
        )

    def line(self) -> str:
        return (
            f"round {self.round} {self.server:<10} c={self.concurrency:<3} "
            f"{self.output_tok_s:8.1f} tok/s  TTFT p50 {self.ttft_p50_ms:7.0f} ms  "
            f"p99 {self.ttft_p99_ms:7.0f} ms  TPOT p50 {self.tpot_p50_ms:6.1f} ms  "
            f"ok {self.completed}, failed {self.failed}"
        )


@dataclass(frozen=True, slots=True)
class Headline:
    """One compared figure: a field of RunFigures at one concurrency."""

    concurrency: int
    field: str  # a float field of RunFigures
    label: str  # what it is, with its unit

    @property
    def name(self) -> str:
        return f"c={self.concurrency} {self.label}"


def headlines(concurrencies: tuple[int, ...]) -> tuple[Headline, ...]:
    """Throughput and tail TTFT at the highest concurrency; TPOT and TTFT at the lowest."""
    high, low = max(concurrencies), min(concurrencies)
    return (
        Headline(high, "output_tok_s", "output tok/s"),
        Headline(high, "ttft_p99_ms", "TTFT p99 ms"),
        Headline(low, "tpot_p50_ms", "TPOT p50 ms"),
        Headline(low, "ttft_p50_ms", "TTFT p50 ms"),
    )


def medians(runs: list[RunFigures], marks: tuple[Headline, ...]) -> dict[str, dict[str, float]]:
    """Per server, per headline: the median over rounds (servers without runs left out)."""
    out: dict[str, dict[str, float]] = {}
    for server in dict.fromkeys(r.server for r in runs):
        figures = {}
        for mark in marks:
            values = [
                getattr(r, mark.field)
                for r in runs
                if r.server == server and r.concurrency == mark.concurrency and r.completed
            ]
            if values:
                figures[mark.name] = statistics.median(values)
        out[server] = figures
    return out


def ratios(by_server: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per pair "ours/peer" (COMPARED, both run): per headline, ours / theirs, where both
    have a non-zero figure."""
    out = {}
    for ours, peers in COMPARED.items():
        for peer in peers:
            if ours in by_server and peer in by_server:
                mine, theirs = by_server[ours], by_server[peer]
                out[f"{ours}/{peer}"] = {
                    name: mine[name] / value
                    for name, value in theirs.items()
                    if value and mine.get(name)
                }
    return out


def format_summary(
    by_server: dict[str, dict[str, float]],
    peer_ratios: dict[str, dict[str, float]],
    marks: tuple[Headline, ...],
) -> str:
    """The medians as a table, one column per server, then one column per compared pair."""
    servers = list(by_server)
    head = ["median over rounds", *servers, *peer_ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mark in marks:
        cells = [mark.name]
        cells += [_cell(by_server[s].get(mark.name), ".1f") for s in servers]
        cells += [_cell(peer_ratios[p].get(mark.name), ".2f", "x") for p in peer_ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"
