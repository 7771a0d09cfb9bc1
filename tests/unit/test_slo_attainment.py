"""`splitserve bench slo`'s arithmetic and flags without any server: SLO attainment over
hand-made records (failed requests count as missing), goodput as the highest rate that
reaches the target, the SLO, rates and configurations parsed or refused by name."""

from __future__ import annotations

import pytest

from loadtest.openloop import RunResult
from loadtest.request import RequestRecord
from loadtest.slo.attainment import Slo, attainment, goodput
from loadtest.slo.config import SloBenchConfig, parse_configs, parse_rates, peer_rows
from loadtest.slo.sweep import Point, goodputs, run_seed
from services.cli import build_parser
from shared.errors import ConfigError

SLO = Slo(ttft_s=1.0, tpot_s=0.04)


def record(ttft: float, tpot: float, tokens: int = 11, error: str = "") -> RequestRecord:
    """A request sent at 0 whose first chunk came at `ttft`, then one every `tpot`."""
    chunks = [ttft + i * tpot for i in range(tokens)]
    return RequestRecord("r", 0.0, chunks, output_tokens=tokens, error=error, end=chunks[-1])


def test_a_request_attains_the_slo_only_within_both_objectives():
    assert SLO.met_by(record(0.5, 0.02))
    assert SLO.met_by(record(1.0, 0.04))  # at the bound: met
    assert not SLO.met_by(record(1.2, 0.02))  # TTFT over
    assert not SLO.met_by(record(0.5, 0.05))  # TPOT over
    assert SLO.met_by(record(0.9, 5.0, tokens=1))  # one token: no TPOT to miss
    assert not SLO.met_by(record(0.1, 0.01, error="http_429"))  # failed: missing


def test_attainment_counts_failed_requests_as_missing():
    records = [record(0.5, 0.02), record(0.6, 0.03), record(2.0, 0.02), record(0.5, 0.09)]
    records += [record(0.1, 0.01, error="timeout")]
    assert attainment(records, SLO) == pytest.approx(2 / 5)
    assert attainment(records[:2], SLO) == 1.0
    assert attainment([], SLO) == 0.0


def test_a_point_keeps_each_requests_latencies_in_send_order():
    late = RequestRecord("long", 2.5, [3.0, 3.1, 3.2], output_tokens=3, end=3.2)
    first = RequestRecord("agent", 1.0, [1.5, 1.52], output_tokens=2, end=1.52)
    lost = RequestRecord("agent", 4.0, [], error="timeout")
    point = Point.of("split", "mixed", 0.5, RunResult([late, first, lost], 1.0, 3.0), SLO)
    assert [row[:2] for row in point.latencies] == [["agent", 0.0], ["long", 1.5], ["agent", 3.0]]
    assert point.latencies[0][2:] == [pytest.approx(0.5), pytest.approx(0.02)]
    assert point.latencies[1][2:] == [pytest.approx(0.5), pytest.approx(0.1)]
    assert point.latencies[2][2:] == [None, None]
    assert (point.met, point.completed, point.errors) == (1, 2, {"timeout": 1})  # TPOT 0.1 s


def test_goodput_is_the_highest_rate_that_reaches_the_target():
    curve = [(0.25, 1.0), (0.5, 0.95), (1.0, 0.9), (2.0, 0.4)]
    assert goodput(curve, 0.9) == 1.0
    assert goodput(curve, 0.95) == 0.5
    assert goodput(curve, 0.99) == 0.25
    assert goodput([(0.25, 0.5), (0.5, 0.2)], 0.9) == 0.0
    assert goodput([(2.0, 0.91), (1.0, 1.0)], 0.9) == 2.0  # order of the points: any


def point(config: str, workload: str, rate: float, share: float) -> Point:
    return Point(config, workload, rate, 10, 10, round(share * 10), share, 0, 0, 0, 0, 1.0)


def test_goodput_per_configuration_and_workload_and_per_core():
    rows = parse_configs("split=prefill:0,decode:1;one=both:0")
    points = [
        point("split", "long", 0.5, 1.0), point("split", "long", 1.0, 0.9),
        point("split", "long", 2.0, 0.5), point("one", "long", 0.5, 0.95),
        point("one", "long", 1.0, 0.6), point("one", "long", 2.0, 0.1),
        point("one", "chat", 0.5, 0.2), point("one", "chat", 1.0, 0.0),
    ]  # fmt: skip
    found = {(g.configuration, g.workload): g for g in goodputs(points, rows, 0.9)}
    assert set(found) == {("split", "long"), ("one", "long"), ("one", "chat")}
    split, one = found["split", "long"], found["one", "long"]
    assert (split.goodput, split.cost, split.per_core) == (1.0, 2, 0.5)
    assert (one.goodput, one.cost, one.per_core) == (0.5, 1, 0.5)
    assert found["one", "chat"].goodput == 0.0


def test_the_slo_needs_both_objectives_with_units():
    assert Slo.parse("ttft=1s,tpot=40ms") == Slo(1.0, 0.04)
    assert Slo.parse(" tpot=0.05s , ttft=800ms ") == Slo(0.8, 0.05)
    for text, message in [
        ("ttft=1.0,tpot=0.04", "needs a unit"),
        ("ttft=1s", "give both"),
        ("ttft=1s,tpot=40ms,e2el=3s", "expected ttft"),
        ("ttft=1s,ttft=2s,tpot=1ms", "expected ttft"),
        ("ttft=fast s,tpot=1ms", "not a number"),
        ("ttft=0s,tpot=1ms", "positive"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Slo.parse(text)


def test_configs_are_named_pools_whose_cost_is_their_cores():
    split, aggregated, two = parse_configs(
        "split=prefill:0,decode:1; aggregated=both:0-1;two=both:0,both:1"
    )
    assert (split.name, [str(p) for p in split.pools]) == ("split", ["prefill:0", "decode:1"])
    assert split.up_args() == ("--pool", "prefill:0", "--pool", "decode:1")
    assert aggregated.up_args() == ("--pool", "both:0-1")
    assert two.up_args() == ("--pool", "both:0", "--pool", "both:1")
    assert [c.cost for c in (split, aggregated, two)] == [2, 2, 2]
    assert parse_configs("wide=both:0,2")[0].cpus == (0, 2)  # a core list with a comma
    (peer,) = peer_rows((split, aggregated, two), "vllm")  # one core set: one row
    assert (peer.name, peer.server, peer.cpus) == ("vllm@0-1", "vllm", (0, 1))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no configuration"),
        ("split", "expected NAME=ROLE:CPUS"),
        ("=both:0", "expected NAME=ROLE:CPUS"),
        ("a=both:0;a=both:1", "given twice"),
        ("a=router:0", "a: pool router:0: the role must be one of"),
        ("a=both:x", "'x' is not a core"),
        ("a=both:1-0", "runs backwards"),
        ("a=prefill:0,decode:0", "core 0 is in two pools"),
        ("a=prefill:0", "no decode or both worker"),
        ("a=0,both:1", "expected ROLE:CPUS"),
    ],
)
def test_a_bad_config_is_refused_naming_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_configs(text)


def test_rates_are_positive_and_sorted():
    assert parse_rates("1, 0.25,2,0.5") == (0.25, 0.5, 1.0, 2.0)
    for text in ("", "0,1", "-1", "1,many", "inf", "1,1"):
        with pytest.raises(ConfigError, match="--rates"):
            parse_rates(text)


def test_the_bench_config_refuses_what_cannot_run():
    configs = parse_configs("one=both:0")
    for kwargs, message in [
        ({"workloads": ("chat", "poetry")}, "poetry"),
        ({"peer": "sglang"}, "--peer"),
        ({"attainment": 1.5}, "attainment"),
        ({"num_prompts": 0}, "must be positive"),
    ]:
        with pytest.raises(ConfigError, match=message):
            SloBenchConfig(configs, **kwargs)
    assert [r.name for r in SloBenchConfig(configs, peer="vllm").rows] == ["one", "vllm@0"]


def test_a_runs_seed_is_its_workloads_and_rates_not_its_configurations():
    assert run_seed(0, "chat", 1) == run_seed(0, "chat", 1)
    seeds = {run_seed(0, w, i) for w in ("chat", "long") for i in range(3)}
    assert len(seeds) == 6 and run_seed(1, "chat", 0) != run_seed(0, "chat", 0)


def test_the_cli_exits_with_a_bad_flags_reason():
    args = build_parser().parse_args(["bench", "slo", "--configs", "a=prefill:0"])
    with pytest.raises(SystemExit, match=r"bench slo: --configs: a: .*no decode or both"):
        args.func(args)
    args = build_parser().parse_args(["bench", "slo", "--configs", "a=both:100000"])
    with pytest.raises(SystemExit, match="bench slo: cpus 100000: not among"):
        args.func(args)
