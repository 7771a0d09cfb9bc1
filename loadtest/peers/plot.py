"""The PNG of `splitserve bench peers`: one panel per headline figure, plus offline.

Each panel has a bar per server at its median over rounds and a dot per round, so the
spread between rounds shows beside the difference between servers.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from loadtest.peers.figures import Headline, RunFigures
from loadtest.peers.offline import OfflineResult


def write_peers_png(
    path: Path,
    runs: list[RunFigures],
    marks: tuple[Headline, ...],
    by_server: dict[str, dict[str, float]],
    offline: OfflineResult | None,
) -> None:
    servers = list(by_server)
    fig = Figure(figsize=(15, 4))
    axes = fig.subplots(1, len(marks) + 1)
    for ax, mark in zip(axes, marks, strict=False):
        heights = [by_server[s].get(mark.name, 0.0) for s in servers]
        ax.bar(servers, heights, alpha=0.6, color=[f"C{i}" for i in range(len(servers))])
        for i, server in enumerate(servers):
            values = [
                getattr(r, mark.field)
                for r in runs
                if r.server == server and r.concurrency == mark.concurrency and r.completed
            ]
            ax.plot([i] * len(values), values, "k.", ms=8)
        ax.set(title=mark.name, ylim=(0, None))
        ax.grid(axis="y", alpha=0.3)
    ax = axes[-1]
    if offline:
        engines = ["splitserve\nengine", "vLLM\nLLM.generate"]
        ax.bar(engines, [offline.ours_tok_s, offline.vllm_tok_s], alpha=0.6, color=["C0", "C1"])
        ax.set(title=f"offline output tok/s (ratio {offline.ratio:.2f}x)")
    else:
        ax.set(title="offline output tok/s (not run)")
    ax.set(ylim=(0, None))
    ax.grid(axis="y", alpha=0.3)
    rounds = max((r.round for r in runs), default=0)
    fig.suptitle(f"splitserve bench peers: bars = median over {rounds} round(s), dots = rounds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
