"""TTFT per request label, printed after a run's table when its requests carry several
labels: a multi-turn run's turns (datasets.py labels them `multi-turn t<N>`), a
scenario's tasks.

The one subtle rule: labels are listed in the order their first request was sent, so a
multi-turn run reads turn by turn. Its turn 1 is a run's own control for the KV tier
(docs/kv_tier.md): nothing is reused from the tier yet, so two runs whose turn 1 differs
were not measured on the same machine state.
"""

from __future__ import annotations

from loadtest.metrics import Stats
from loadtest.request import RequestRecord


def ttft_by_label(records: list[RequestRecord]) -> dict[str, Stats]:
    """TTFT statistics (ms) of the successful requests of each label, first sent first."""
    ttfts: dict[str, list[float]] = {}
    for record in sorted(records, key=lambda r: r.send):
        values = ttfts.setdefault(record.label, [])
        if record.ok and record.chunk_times:
            values.append(record.ttft)
    return {label: Stats.of(values) for label, values in ttfts.items()}


def format_by_label(records: list[RequestRecord]) -> str:
    """The per-label TTFT lines; "" when the run has a single label."""
    stats = ttft_by_label(records)
    if len(stats) < 2:
        return ""
    width = max(len(label) for label in stats)
    lines = [f"{'TTFT by label (ms)':<{width}}  {'n':>5} {'mean':>9} {'p50':>9} {'p99':>9}"]
    for label, s in stats.items():
        lines.append(
            f"{label:<{width}}  {s.count:>5} {s.mean:>9.1f} {s.median:>9.1f} {s.p99:>9.1f}"
        )
    return "\n".join(lines)
