"""What `splitserve bench sim` prints and leaves in `--out`: `bench slo`'s table, JSON and
PNG for a sweep (`sim.json`, `sim.png`, with the cost model and the planner's decisions),
the ranked goodputs and the answer for `--search` (`search.json`), and the side-by-side
table for `--compare` (`compare.json`).

The one subtle rule: the cost model's name and source head every table and sit in every
JSON, so no output hides that its figures are modelled (or, for a GPU, not measured at all).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from loadtest.sim.compare import Measured, compare, comparison_json, format_comparison
from loadtest.sim.config import SimBenchConfig
from loadtest.sim.run import search, sweep
from loadtest.slo.report import format_tables, result_json, write_png
from loadtest.slo.sweep import Goodput, goodputs


def header(cfg: SimBenchConfig) -> str:
    cost = cfg.cost
    path = cfg.settings.scheduler.path_choice
    return (
        f"simulated: cost model {cost.name} ({cost.model}): {cost.source}; "
        f"path choice {path}{'; planner' if cfg.planner else ''}"
    )


def model_json(cfg: SimBenchConfig) -> dict[str, object]:
    return {
        "cost_model": cfg.cost.as_json(),
        "path_choice": cfg.settings.scheduler.path_choice,
        "token_budget": cfg.settings.limits.max_num_batched_tokens,
        "planner": bool(cfg.planner),
        "planner_interval_s": cfg.planner_interval_s,
        "planner_window_s": cfg.planner_window_s,
    }


def run_sweep(cfg: SimBenchConfig) -> None:
    print(header(cfg))
    began = time.perf_counter()
    runs = sweep(cfg)
    points = [ran.point for ran in runs]
    found = goodputs(points, cfg.bench.rows, cfg.bench.attainment)
    print(format_tables(cfg.bench, points, found))
    print(f"({time.perf_counter() - began:.1f} s of wall time)")
    out = cfg.bench.out
    decisions = [
        {"configuration": p.configuration, "workload": p.workload, "rate": p.rate, "decisions": d}
        for p, d in ((ran.point, ran.decisions) for ran in runs)
        if d
    ]
    simulator = model_json(cfg) | {"decisions": decisions}
    data = result_json(cfg.bench, points, found) | {"simulator": simulator}
    dump(out / "sim.json", data)
    write_png(out / "sim.png", cfg.bench, points)
    print(f"wrote {out / 'sim.json'} and {out / 'sim.png'}")


def run_search(cfg: SimBenchConfig) -> None:
    print(header(cfg))
    began = time.perf_counter()
    found = search(cfg)
    lines = ["", f"{'configuration':<36}{'workload':<10}{'cores':>6}{'goodput':>10}{'/core':>8}"]
    lines += [
        f"{g.configuration:<36}{g.workload:<10}{g.cost:>6}{g.goodput:>10g}{g.per_core:>8.3g}"
        for g in found
    ]
    for workload in cfg.bench.workloads:
        lines.append(best_line(workload, found, max(cfg.bench.rates)))
    print("\n".join(lines))
    print(f"({time.perf_counter() - began:.1f} s of wall time)")
    data = {
        "simulator": model_json(cfg),
        "slo": {"ttft_s": cfg.bench.slo.ttft_s, "tpot_s": cfg.bench.slo.tpot_s},
        "rates": list(cfg.bench.rates),
        "goodput": [asdict(g) for g in found],
    }
    dump(cfg.bench.out / "search.json", data)


def best_line(workload: str, found: list[Goodput], top_rate: float) -> str:
    """The configurations of the highest goodput for `workload` (ties named together)."""
    rows = [g for g in found if g.workload == workload]
    best = max(g.goodput for g in rows)
    if not best:
        return f"best for {workload}: none reaches the SLO at the lowest rate"
    tied = [g.configuration for g in rows if g.goodput == best]
    shown = "; ".join(tied[:4]) + (f"; and {len(tied) - 4} more" if len(tied) > 4 else "")
    top = " (the highest rate swept: try higher --rates)" if best >= top_rate else ""
    return f"best for {workload}: {best:g} req/s{top}, by {shown}"


def run_compare(cfg: SimBenchConfig, measured: Measured) -> None:
    print(header(cfg))
    print(f"long prompts: {cfg.bench.long_len} tokens (slo.json does not record it: --long-len)")
    sides, measured_goodput, simulated_goodput = compare(cfg, measured)
    print(format_comparison(cfg, sides, measured_goodput, simulated_goodput))
    data = comparison_json(cfg, sides, measured_goodput, simulated_goodput)
    dump(cfg.bench.out / "compare.json", data | {"simulator": model_json(cfg)})
    print(f"wrote {cfg.bench.out / 'compare.json'}")


def dump(path: Path, data: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
