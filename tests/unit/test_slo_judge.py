"""`splitserve bench slo-judge`: goodput judged again from saved points under another SLO,
files judged together with clashing names told apart, and files without latencies refused."""

from __future__ import annotations

import json

import pytest

from loadtest.slo.attainment import Slo
from loadtest.slo.judge import judge_results, main
from services.cli import build_parser
from shared.errors import ConfigError


def result(name: str, cost: int, points: dict[float, list[list[object]]]) -> dict:
    return {
        "configurations": [{"name": name, "cost": cost}],
        "points": [
            {
                "configuration": name,
                "workload": "long",
                "rate": rate,
                "requests": len(rows),
                "latencies": rows,
            }
            for rate, rows in points.items()
        ],
    }


SPLIT = result(
    "split",
    2,
    {
        0.1: [["long", 0.0, 2.0, 0.03], ["long", 9.0, 2.5, 0.03]],
        0.2: [["long", 0.0, 3.5, 0.03], ["long", 5.0, 5.0, 0.03]],
    },
)


def test_the_same_points_judged_under_two_slos_give_two_goodputs():
    loose = judge_results([("run", SPLIT)], Slo(4.0, 0.05), 0.9)[0]
    assert loose.curve == ((0.1, 1.0), (0.2, 0.5)) and loose.goodput == 0.1
    looser = judge_results([("run", SPLIT)], Slo(6.0, 0.05), 0.9)[0]
    assert looser.goodput == 0.2
    tight_tpot = judge_results([("run", SPLIT)], Slo(6.0, 0.02), 0.9)[0]
    assert tight_tpot.goodput == 0.0


def test_failed_requests_count_as_missing_and_one_token_has_no_tpot():
    rows = [["x", 0.0, 1.0, None], ["x", 1.0, None, None]]
    judged = judge_results([("r", result("c", 1, {0.5: rows}))], Slo(2.0, 0.01), 0.5)[0]
    assert judged.curve == ((0.5, 0.5),) and judged.goodput == 0.5


def test_files_judged_together_tell_clashing_names_apart():
    other = result("split", 2, {0.1: [["long", 0.0, 9.0, 0.03]]})
    judged = judge_results([("always", SPLIT), ("cost", other)], Slo(4.0, 0.05), 0.9)
    assert [j.configuration for j in judged] == ["always/split", "cost/split"]
    assert [j.goodput for j in judged] == [0.1, 0.0]


def test_a_file_without_latencies_is_refused(tmp_path):
    old = result("split", 2, {0.1: []})
    old["points"][0]["requests"] = 4
    with pytest.raises(ConfigError, match="no latencies"):
        judge_results([("old", old)], Slo(4.0, 0.05), 0.9)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "slo.json").write_text(json.dumps(SPLIT))
    args = build_parser().parse_args(
        ["bench", "slo-judge", str(tmp_path / "run"), "--slo", "ttft=4"]
    )
    with pytest.raises(SystemExit, match="needs a unit"):
        main(args)
