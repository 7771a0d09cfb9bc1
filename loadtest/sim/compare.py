"""`bench sim --compare SLO_JSON`: the configurations, workloads, rates, SLO and seed of a
measured `bench slo` run, simulated, and set beside what was measured: attainment, TTFT and
TPOT p50 per point, goodput per configuration.

The seeds are `bench slo`'s, so each simulated run replays the very requests and send times
the measured run sent. Peer rows (vLLM) are not simulated.

The one subtle rule: `slo.json` does not say how long its long prompts were (`--long-len`),
nor the model's vocabulary: the caller says (`long_len`), or the defaults are assumed and
printed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loadtest.sim.config import SimBenchConfig
from loadtest.sim.run import sweep
from loadtest.slo.attainment import Slo
from loadtest.slo.config import Configuration, SloBenchConfig
from loadtest.slo.sweep import Goodput, Point, goodputs
from services.launch_plan import PinnedPool
from shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Measured:
    bench: SloBenchConfig
    points: list[Point]


def read_measured(path: Path, long_len: int) -> Measured:
    """A `bench slo` JSON as the config that made it (our configurations only) and its
    points; ConfigError when it is not one."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        configs = tuple(
            Configuration(
                c["name"], tuple(PinnedPool(p["role"], tuple(p["cpus"])) for p in c["pools"])
            )
            for c in data["configurations"]
            if c.get("server", "splitserve") == "splitserve"
        )
        names = {c.name for c in configs}
        points = [Point(**p) for p in data["points"] if p["configuration"] in names]
        bench = SloBenchConfig(
            configs=configs,
            slo=Slo(data["slo"]["ttft_s"], data["slo"]["tpot_s"]),
            workloads=tuple(data["workloads"]),
            rates=tuple(data["rates"]),
            num_prompts=data["num_prompts"],
            attainment=data["attainment_target"],
            phase_seconds=data["shift"]["phase_seconds"],
            phases=data["shift"]["phases"],
            shift_mix=tuple(data["shift"].get("mix", ("chat", "long"))),
            long_len=data.get("long_len", long_len),
            seed=data["seed"],
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--compare {path}: not a bench slo JSON ({exc!r})") from None
    return Measured(bench, points)


@dataclass(frozen=True, slots=True)
class Side:
    configuration: str
    workload: str
    rate: float
    measured: Point | None
    simulated: Point


def compare(
    cfg: SimBenchConfig, measured: Measured
) -> tuple[list[Side], list[Goodput], list[Goodput]]:
    """Simulate `measured`'s runs with `cfg`'s cost model and settings: each point beside
    its measurement, and both goodputs."""
    cfg = replace(cfg, bench=measured.bench)
    simulated = [ran.point for ran in sweep(cfg, say=lambda _: None)]
    by_key = {(p.configuration, p.workload, p.rate): p for p in measured.points}
    sides = [
        Side(
            p.configuration,
            p.workload,
            p.rate,
            by_key.get((p.configuration, p.workload, p.rate)),
            p,
        )
        for p in simulated
    ]
    target, rows = measured.bench.attainment, measured.bench.configs
    return sides, goodputs(measured.points, rows, target), goodputs(simulated, rows, target)


def format_comparison(
    cfg: SimBenchConfig, sides: list[Side], measured: list[Goodput], simulated: list[Goodput]
) -> str:
    lines = [
        f"cost model {cfg.cost.name}: {cfg.cost.source}",
        f"{'point':<34}{'attainment':>16}{'TTFT p50 ms':>20}{'TPOT p50 ms':>18}",
        f"{'':<34}{'meas':>8}{'sim':>8}{'meas':>10}{'sim':>10}{'meas':>9}{'sim':>9}",
    ]
    for side in sides:
        m, s = side.measured, side.simulated
        name = f"{side.configuration} {side.workload} @ {side.rate:g}/s"
        meas = (
            f"{m.attainment:>8.0%}" if m else f"{'-':>8}",
            f"{m.ttft_p50_ms:>10.0f}" if m else f"{'-':>10}",
            f"{m.tpot_p50_ms:>9.1f}" if m else f"{'-':>9}",
        )
        lines.append(
            f"{name:<34}{meas[0]}{s.attainment:>8.0%}{meas[1]}{s.ttft_p50_ms:>10.0f}"
            f"{meas[2]}{s.tpot_p50_ms:>9.1f}"
        )
    lines += ["", f"{'goodput (req/s)':<34}{'meas':>8}{'sim':>8}{'sim/meas':>10}"]
    for m_g, s_g in zip(measured, simulated, strict=True):
        ratio = f"{s_g.goodput / m_g.goodput:>10.2f}" if m_g.goodput else f"{'-':>10}"
        name = f"{m_g.configuration} {m_g.workload}"
        lines.append(f"{name:<34}{m_g.goodput:>8g}{s_g.goodput:>8g}{ratio}")
    return "\n".join(lines)


def comparison_json(
    cfg: SimBenchConfig, sides: list[Side], measured: list[Goodput], simulated: list[Goodput]
) -> dict[str, object]:
    def brief(p: Point | None) -> dict[str, object] | None:
        if p is None:
            return None
        keep = ("attainment", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
        return {k: v for k, v in asdict(p).items() if k in keep}

    return {
        "cost_model": {"name": cfg.cost.name, "source": cfg.cost.source},
        "long_len": cfg.bench.long_len,
        "points": [
            {
                "configuration": s.configuration,
                "workload": s.workload,
                "rate": s.rate,
                "measured": brief(s.measured),
                "simulated": brief(s.simulated),
            }
            for s in sides
        ],
        "goodput": {
            "measured": [asdict(g) for g in measured],
            "simulated": [asdict(g) for g in simulated],
        },
    }
