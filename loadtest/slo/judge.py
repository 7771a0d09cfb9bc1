"""`splitserve bench slo-judge`: goodput judged again from saved `bench slo` results, under
another SLO or attainment target, with no server run (each point keeps its requests'
latencies: sweep.py `Point.latencies`).

Several result files may be judged together (e.g. one per scheduler policy): a
configuration's name is then prefixed with its file's directory name wherever two files
use the same name. The one subtle rule: a request that failed, or whose latencies the file
lacks, counts as missing, as in the run itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from loadtest.slo.attainment import Slo, goodput
from shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Judged:
    configuration: str
    workload: str
    cost: int
    curve: tuple[tuple[float, float], ...]  # (rate, attainment), ascending rate
    goodput: float


def met(row: list[object], slo: Slo) -> bool:
    """A saved request ([label, offset, ttft, tpot]) within both objectives."""
    _, _, ttft, tpot = row
    return ttft is not None and slo.within(float(ttft), None if tpot is None else float(tpot))


def judge_results(results: list[tuple[str, dict]], slo: Slo, target: float) -> list[Judged]:
    """`results`: (source name, parsed slo.json) pairs; one `Judged` per configuration and
    workload, in file order."""
    names = [c["name"] for _, result in results for c in result["configurations"]]
    clash = {n for n in names if names.count(n) > 1}
    judged = []
    for source, result in results:
        cost = {c["name"]: c["cost"] for c in result["configurations"]}
        curves: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for point in result["points"]:
            rows = point.get("latencies") or []
            if not rows and point["requests"]:
                raise ConfigError(f"{source}: its points keep no latencies (made before they did)")
            share = sum(met(r, slo) for r in rows) / point["requests"] if point["requests"] else 0.0
            key = (point["configuration"], point["workload"])
            curves.setdefault(key, []).append((point["rate"], share))
        for (name, workload), curve in curves.items():
            shown = f"{source}/{name}" if name in clash else name
            ordered = tuple(sorted(curve))
            judged.append(Judged(shown, workload, cost[name], ordered, goodput(ordered, target)))
    return judged


def format_judged(judged: list[Judged], slo: Slo, target: float) -> str:
    lines = [
        f"SLO: TTFT <= {slo.ttft_s * 1000:g} ms and TPOT <= {slo.tpot_s * 1000:g} ms; "
        f"goodput: the highest rate with attainment >= {target:.0%}"
    ]
    for workload in dict.fromkeys(j.workload for j in judged):
        lines += ["", f"{workload}: configuration, cores, attainment per rate, goodput, per core"]
        for j in (j for j in judged if j.workload == workload):
            curve = "  ".join(f"{rate:g}/s {share:.0%}" for rate, share in j.curve)
            per_core = f"{j.goodput / j.cost:.3g}"
            lines.append(
                f"  {j.configuration:<24}{j.cost:>3}   {curve}   {j.goodput:g} ({per_core})"
            )
    return "\n".join(lines)


def add_parser(targets: argparse._SubParsersAction) -> None:
    judge = targets.add_parser("slo-judge", help="goodput again from bench slo's JSON, another SLO")
    judge.add_argument("results", nargs="+", type=Path, help="slo.json files (or their dirs)")
    judge.add_argument("--slo", required=True, help="ttft=…,tpot=…, each with s or ms")
    judge.add_argument("--attainment", type=float, default=0.9, help="target share of requests")
    judge.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    try:
        slo = Slo.parse(args.slo)
        if not 0 < args.attainment <= 1:
            raise ConfigError("--attainment must be in (0, 1]")
        results = []
        for path in args.results:
            file = path / "slo.json" if path.is_dir() else path
            if not file.is_file():
                raise ConfigError(f"{file}: no such file")
            results.append((file.parent.name, json.loads(file.read_text())))
        print(format_judged(judge_results(results, slo, args.attainment), slo, args.attainment))
    except ConfigError as exc:
        sys.exit(f"splitserve bench slo-judge: {exc}")
