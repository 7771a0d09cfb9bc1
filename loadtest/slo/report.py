"""What `splitserve bench slo` leaves: a table per workload (attainment per rate, goodput,
goodput per core), `slo.json` (the run's settings, each configuration, every point and every
goodput) and `slo.png` (attainment against rate, a line per configuration, a panel per
workload, the target as a dashed line).

The one subtle rule: the JSON holds every point, so the PNG and the table can be made again
from it; its `points` and `goodput` rows are the dataclasses of sweep.py as they are.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from matplotlib.figure import Figure

from loadtest.slo.config import SloBenchConfig
from loadtest.slo.sweep import Goodput, Point

METHOD = (
    "DistServe's goodput: per configuration and workload, the highest request rate whose "
    "SLO attainment (the share of requests, failed ones included, with TTFT and TPOT both "
    "within the SLO) is at least the target; Poisson arrivals; per core: goodput / cores"
)


def result_json(
    cfg: SloBenchConfig, points: list[Point], goodputs: list[Goodput]
) -> dict[str, object]:
    return {
        "method": METHOD,
        "slo": {"ttft_s": cfg.slo.ttft_s, "tpot_s": cfg.slo.tpot_s},
        "attainment_target": cfg.attainment,
        "rates": list(cfg.rates),
        "workloads": list(cfg.workloads),
        "num_prompts": cfg.num_prompts,
        "shift": {
            "phase_seconds": cfg.phase_seconds,
            "phases": cfg.phases,
            "mix": list(cfg.shift_mix),
        },
        "seed": cfg.seed,
        "up_args": list(cfg.up_args),
        "configurations": [row.as_json() for row in cfg.rows],
        "points": [asdict(p) for p in points],
        "goodput": [asdict(g) for g in goodputs],
    }


def format_tables(cfg: SloBenchConfig, points: list[Point], goodputs: list[Goodput]) -> str:
    rates = "".join(f"{f'{r:g}/s':>8}" for r in cfg.rates)
    lines = [
        f"SLO: TTFT <= {cfg.slo.ttft_s * 1000:g} ms and TPOT <= {cfg.slo.tpot_s * 1000:g} "
        f"ms; goodput: the highest rate with attainment >= {cfg.attainment:.0%}"
    ]
    for workload in cfg.workloads:
        lines += ["", f"{workload:<20}{'cores':>6}{rates}{'goodput':>10}{'/core':>8}"]
        for g in (g for g in goodputs if g.workload == workload):
            shares = {
                p.rate: p.attainment
                for p in points
                if (p.configuration, p.workload) == (g.configuration, workload)
            }
            cells = "".join(f"{shares[r]:>8.0%}" if r in shares else f"{'-':>8}" for r in cfg.rates)
            lines.append(
                f"{g.configuration:<20}{g.cost:>6}{cells}{g.goodput:>10g}{g.per_core:>8.3g}"
            )
    return "\n".join(lines)


def write_png(path: Path, cfg: SloBenchConfig, points: list[Point]) -> None:
    workloads = list(cfg.workloads)
    fig = Figure(figsize=(4.5 * len(workloads), 4))
    axes = fig.subplots(1, len(workloads), squeeze=False)[0]
    for ax, workload in zip(axes, workloads, strict=True):
        for row in cfg.rows:
            curve = sorted(
                (p.rate, p.attainment)
                for p in points
                if (p.configuration, p.workload) == (row.name, workload)
            )
            if curve:
                rates, shares = zip(*curve, strict=True)
                ax.plot(rates, shares, marker="o", label=f"{row.name} ({row.cost} cores)")
        ax.axhline(cfg.attainment, color="k", ls="--", lw=1, label=f"target {cfg.attainment:.0%}")
        ax.set(
            title=workload,
            xlabel="request rate (req/s)",
            ylabel="SLO attainment",
            ylim=(-0.02, 1.02),
            xscale="log",
        )
        ax.set_xticks(list(cfg.rates), [f"{r:g}" for r in cfg.rates])
        ax.minorticks_off()  # a log axis labels its minor ticks too: only the swept rates
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"splitserve bench slo: TTFT <= {cfg.slo.ttft_s * 1000:g} ms, TPOT <= "
        f"{cfg.slo.tpot_s * 1000:g} ms"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def write_results(
    cfg: SloBenchConfig, points: list[Point], goodputs: list[Goodput]
) -> tuple[Path, Path]:
    """slo.json and slo.png in `cfg.out`; their paths."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = cfg.out / "slo.json", cfg.out / "slo.png"
    json_path.write_text(json.dumps(result_json(cfg, points, goodputs), indent=1))
    write_png(png_path, cfg, points)
    return json_path, png_path
