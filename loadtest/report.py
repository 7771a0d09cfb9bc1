"""The terminal table and the JSON result file of a run."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.metrics import Stats, Summary
from loadtest.openloop import RunResult
from loadtest.request import RequestRecord

ROW = "{:<44}{:>11}{:>11}{:>11}{:>11}"


def _stats_rows(name: str, stats: Stats, unit: str = "ms") -> list[str]:
    return [
        ROW.format(
            f"{name} ({unit})",
            *(f"{v:.2f}" for v in (stats.mean, stats.median, stats.p90, stats.p99)),
        )
    ]


def format_table(title: str, s: Summary) -> str:
    lines = [f"{'=' * 22} {title} {'=' * max(0, 63 - len(title))}"]
    pairs: list[tuple[str, Any]] = [
        ("Successful requests", s.completed),
        ("Failed requests", s.failed),
        *((f"  errors: {kind}", n) for kind, n in sorted(s.errors.items())),
        ("Benchmark duration (s)", f"{s.duration_s:.2f}"),
        ("Total input tokens (usage)", s.total_input_tokens),
        ("Total output tokens (usage)", s.total_output_tokens),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.2f}"),
        ("Peak concurrent requests", s.max_concurrency_seen),
    ]
    if s.goodput is not None:
        pairs.append(("Request goodput (req/s)", f"{s.goodput:.2f}"))
    lines += [f"{k:<44}{v:>11}" for k, v in pairs]
    lines.append("-" * 88)
    lines.append(ROW.format("vLLM definitions", "mean", "median", "p90", "p99"))
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines += _stats_rows(name.upper(), getattr(s, name))
    for tool, metrics in (("AIPerf", s.aiperf), ("guidellm", s.guidellm)):
        lines.append(ROW.format(f"{tool} variants", "", "", "", ""))
        for name, stats in metrics.items():
            unit = "tok/s" if name.endswith("per_user") else "ms"
            lines += _stats_rows(f"  {name}", stats, unit)
    for kind, detail in sorted(s.error_examples.items()):
        lines.append(f"{kind}: {detail}"[:88])
    lines.append("=" * 88)
    return "\n".join(lines)


def result_json(config: dict[str, Any], summary: Summary, run: RunResult) -> dict[str, Any]:
    return {
        "config": config,
        "summary": asdict(summary),
        "requests": [
            {
                "label": r.label,
                "send_s": r.send - run.start,
                "end_s": r.end - run.start,
                "ttft_s": r.ttft if r.ok else None,
                "e2el_s": r.e2el if r.ok else None,
                "itl_s": r.itls if r.ok else [],
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "error": r.error,
                "error_detail": r.error_detail,
            }
            for r in run.records
        ],
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))


def run_from_json(payload: dict[str, Any]) -> RunResult:
    """The run back from a result file (times relative to its start), to plot it again."""
    records = []
    for r in payload["requests"]:
        chunks: list[float] = []
        if r["ttft_s"] is not None:
            chunks = [r["send_s"] + r["ttft_s"]]
            for gap in r["itl_s"]:
                chunks.append(chunks[-1] + gap)
        records.append(RequestRecord(
            r["label"], r["send_s"], chunks, r["prompt_tokens"], r["output_tokens"],
            usage_reported=True, error=r["error"], error_detail=r.get("error_detail", ""),
            end=r["end_s"],
        ))  # fmt: skip
    return RunResult(records, 0.0, payload["summary"]["duration_s"])
