"""`bench sim`'s configurations, search and comparison: `--workers` parsing, the splits of N
workers, a measured `slo.json` compared with its simulation, and the CLI's outputs."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.sim import cli
from loadtest.sim.compare import compare, read_measured
from loadtest.sim.config import parse_workers, splits, worker_specs
from loadtest.sim.mesh import WorkerSpec
from loadtest.sim.report import best_line, run_sweep
from loadtest.sim.run import search, sweep, with_configs
from loadtest.slo.report import result_json
from loadtest.slo.sweep import Goodput, goodputs
from services.planner.decision import Action, Decision, Reason
from services.planner.signals import MeshSignals
from shared.errors import ConfigError


def test_workers_parse_into_configurations_on_virtual_cores() -> None:
    split, wide = parse_workers("split=prefill:2,decode:1;both:1x2")
    assert split.name == "split" and split.cost == 3
    assert worker_specs(split) == [
        WorkerSpec("prefill"),
        WorkerSpec("prefill"),
        WorkerSpec("decode"),
    ]
    assert wide.name == "both:1x2" and worker_specs(wide) == [WorkerSpec("both", 2)]


@pytest.mark.parametrize(
    "text", ["prefill:2", "gpu:1", "decode:x", "a=decode:1;a=both:1", "", "decode:1x0"]
)
def test_bad_workers_are_refused_by_name(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_workers(text)


def test_splits_cover_every_split_with_a_decoding_worker() -> None:
    found = splits(4, 1)
    # (prefill, decode, both) with p + d + b = 4: 15 triples, less (4, 0, 0)
    assert len(found) == 14
    assert all(any(p.role != "prefill" for p in c.pools) for c in found)
    assert all(c.cost == 4 for c in found)
    assert len({c.name for c in found}) == 14
    coarse = splits(64, 8)
    assert len(coarse) == 44 and all(c.cost == 64 for c in coarse)


def _args(tmp_path: Path, **changes: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    argv = ["sim", "--rates", "0.5,2", "--num-prompts", "12", "--long-len", "256"]
    argv += ["--slo", "ttft=4s,tpot=100ms", "--out", str(tmp_path)]
    args = parser.parse_args(argv)
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def test_a_measured_run_compared_with_itself_matches(tmp_path: Path) -> None:
    """A simulated sweep written as `bench slo` writes it reads back as a measurement whose
    simulation gives the same points: the comparison replays the very same requests."""
    cfg = cli.config_from_args(_args(tmp_path, workers="split=prefill:1,decode:1;two=both:2"))
    points = [ran.point for ran in sweep(cfg, say=lambda _: None)]
    found = goodputs(points, cfg.bench.rows, cfg.bench.attainment)
    path = tmp_path / "slo.json"
    path.write_text(json.dumps(result_json(cfg.bench, points, found)))
    measured = read_measured(path, long_len=256)
    sides, measured_goodput, simulated_goodput = compare(cfg, measured)
    assert [s.simulated for s in sides] == [s.measured for s in sides] == points
    assert measured_goodput == simulated_goodput == found


def test_search_ranks_the_splits_by_goodput(tmp_path: Path) -> None:
    cfg = cli.config_from_args(_args(tmp_path, workloads="chat"))
    found = search(with_configs(cfg, splits(2, 1)), say=lambda _: None)
    assert len(found) == 5  # (0,2,0) (0,1,1) (0,0,2) (1,1,0) (1,0,1)
    assert [g.goodput for g in found] == sorted((g.goodput for g in found), reverse=True)


def test_the_cli_writes_the_slo_shape_with_the_cost_model(tmp_path: Path, capsys) -> None:
    args = _args(tmp_path, workers="prefill:1,decode:1", cost_model="gpu-h100-published")
    cli.main(args)
    printed = capsys.readouterr().out
    assert "published figures, not measured" in printed.splitlines()[0]
    data = json.loads((tmp_path / "sim.json").read_text())
    assert {"points", "goodput", "configurations", "simulator"} <= set(data)
    assert data["simulator"]["cost_model"]["source"] == "published figures, not measured"
    assert (tmp_path / "sim.png").is_file()


def test_the_real_planner_decides_inside_the_simulation(tmp_path: Path) -> None:
    """`--planner` runs services.planner.policy.Planner on the simulated mesh: on the shift
    workload it changes roles, each decision lands in the run's record, and the same seed
    gives the same decisions."""
    args = _args(
        tmp_path,
        planner=True,
        planner_interval=2.0,
        workers="planned=both:1,both:1",
        workloads="shift",
        rates="0.5",
        phase_seconds=60.0,
        phases=2,
        long_len=1024,
        slo="ttft=4s,tpot=50ms",
    )
    cfg = cli.config_from_args(args)
    first = [ran.decisions for ran in sweep(cfg, say=lambda _: None)]
    assert any(row[1] == "SET_ROLE" for decisions in first for row in decisions)
    assert first == [ran.decisions for ran in sweep(cfg, say=lambda _: None)]


def test_the_best_names_every_tie_and_says_when_the_rates_ran_out() -> None:
    found = [
        Goodput("a", "chat", 2, 4.0, 2.0),
        Goodput("b", "chat", 2, 4.0, 2.0),
        Goodput("c", "chat", 2, 1.0, 0.5),
        Goodput("d", "long", 2, 0.0, 0.0),
    ]
    line = best_line("chat", found, top_rate=4.0)
    assert "4 req/s" in line and "by a; b" in line and "higher --rates" in line
    assert "higher" not in best_line("chat", found, top_rate=8.0)
    assert "none reaches" in best_line("long", found, top_rate=8.0)


class AddOnce:
    """Adds one decode worker at its first call, then holds."""

    def __init__(self) -> None:
        self.calls = 0

    def decide(self, signals: MeshSignals) -> list[Decision]:
        self.calls += 1
        return [Decision(Action.ADD, Reason.TPOT_OVER_SLO, "decode")] if self.calls == 1 else []


def test_a_sweep_with_a_planner_keeps_its_decisions(tmp_path: Path) -> None:
    cfg = cli.config_from_args(_args(tmp_path, workers="prefill:1,decode:1", rates="0.5"))
    run_sweep(replace(cfg, planner=AddOnce, planner_interval_s=1.0))
    runs = json.loads((tmp_path / "sim.json").read_text())["simulator"]["decisions"]
    assert len(runs) == 1 and runs[0]["rate"] == 0.5
    assert [d[1:4] for d in runs[0]["decisions"]] == [["ADD", "TPOT_OVER_SLO", "decode"]]
