"""The PNG report of a run: latency CDFs, throughput and concurrency over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from loadtest.metrics import Summary
from loadtest.openloop import RunResult


def _cdf(ax: Axes, values: list[float], label: str) -> None:
    """Empirical CDF as a step function, in milliseconds."""
    if values:
        xs = np.sort(np.asarray(values) * 1000)
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(np.concatenate([[0.0], xs]), np.concatenate([[0.0], ys]), where="post",
                label=label)  # fmt: skip


def _throughput(run: RunResult, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Bin starts and output tokens/s per bin (a chunk's tokens = usage / chunks)."""
    edges = np.arange(0.0, run.duration + bin_s, bin_s)
    tokens = np.zeros(len(edges))
    for r in run.records:
        if r.ok and r.chunk_times:
            per_chunk = r.output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[min(int((t - run.start) / bin_s), len(edges) - 1)] += per_chunk
    return edges, tokens / bin_s


def _in_flight(run: RunResult) -> tuple[list[float], list[int]]:
    """Exact step function of requests in flight: times and the level after each."""
    events = sorted(
        [(r.send - run.start, 1) for r in run.records]
        + [(r.end - run.start, -1) for r in run.records]
    )
    times, levels, level = [0.0], [0], 0
    for t, step in events:
        level += step
        times.append(t)
        levels.append(level)
    return times, levels


def write_png(path: Path, title: str, run: RunResult, summary: Summary) -> None:
    ok = [r for r in run.records if r.ok]
    fig = Figure(figsize=(12, 8))
    axes = fig.subplots(2, 2)
    ax = axes[0][0]
    _cdf(ax, [r.ttft for r in ok], "TTFT")
    _cdf(ax, [r.e2el for r in ok], "E2EL")
    ax.set(title="request latency CDF", xlabel="ms", ylabel="fraction of requests")
    ax = axes[0][1]
    _cdf(ax, [t for r in ok if (t := r.tpot) is not None], "TPOT")
    _cdf(ax, [g for r in ok for g in r.itls], "ITL")
    ax.set(title="token latency CDF", xlabel="ms", ylabel="fraction")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend()
    bin_s = max(0.25, run.duration / 60)
    edges, tok_s = _throughput(run, bin_s)
    ax = axes[1][0]
    ax.bar(edges, tok_s, width=bin_s, align="edge", alpha=0.7)
    ax.axhline(
        summary.output_throughput,
        color="k",
        ls="--",
        label=f"mean {summary.output_throughput:.1f} tok/s",
    )
    ax.set(title="output throughput over time", xlabel="s", ylabel="tokens/s")
    ax.legend()
    ax = axes[1][1]
    ax.step(*_in_flight(run), where="post")
    ax.set(title="requests in flight", xlabel="s", ylabel="requests")
    for ax in axes[1]:
        ax.grid(alpha=0.3)
    errors = ", ".join(f"{k}={v}" for k, v in summary.errors.items()) or "none"
    fig.suptitle(
        f"{title} — {summary.completed} ok, errors: {errors}; "
        f"TTFT p50 {summary.ttft.median:.0f} ms, TPOT p50 {summary.tpot.median:.1f} ms"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
