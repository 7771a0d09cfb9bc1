"""The planner's policy on recorded signal sequences: replicas mode's rules, the bounds, the
hysteresis (a need must hold, cooldown, waiting for a decision's effect, no decision
mid-change) and no decision without a signal."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.planner.config import PlannerConfig
from services.planner.counts import RoleCounts, counts_after, live_counts
from services.planner.decision import Action, Decision, Reason
from services.planner.policy import Planner
from services.planner.signals import MeshSignals
from tests.unit.planner_signals import CONFIG, every, run, snap, worker

SPLIT = [worker("p0", "prefill"), worker("d0", "decode")]


def actions(decisions: list[Decision]) -> list[tuple[Action, str, Reason]]:
    return [(d.action, d.role, d.reason) for d in decisions]


def test_no_worker_or_nothing_measured_is_no_signal_and_holds():
    planner = Planner(CONFIG)
    idle = [worker("p0", "prefill", num_running=0), worker("d0", "decode", num_running=0)]
    series = [
        MeshSignals(0.0, ()),
        MeshSignals(5.0, ()),
        snap(10.0, idle, ttft=0.0, tpot=0.0, samples=0),
        snap(15.0, idle, ttft=0.0, tpot=0.0, samples=0),
    ]
    for signals in series:
        assert planner.decide(signals) == []
        assert planner.hold_reason is Reason.NO_SIGNAL
        assert planner.holding.startswith("no signal")


def test_ttft_over_the_slo_adds_a_prefill_worker_once_it_held():
    planner = Planner(CONFIG)
    assert planner.decide(snap(0, SPLIT, ttft=1.5)) == []
    assert planner.holding.endswith("(1/2 snapshots)")
    second = planner.decide(snap(5, SPLIT, ttft=1.5))
    assert actions(second) == [(Action.ADD, "prefill", Reason.TTFT_OVER_SLO)]
    assert "TTFT p99 1.500 s > 1.000 s" in second[0].detail


def test_a_growing_prefill_queue_adds_prefill_before_any_first_token_is_late():
    # 3000 queued prompt tokens at 1000 tokens/s: 3 s of queue > 0.8 x the 1 s objective.
    queued = [worker("p0", "prefill", queued_prompt_tokens=3000), worker("d0", "decode")]
    decisions = run(Planner(CONFIG), [snap(t, queued, samples=0) for t in every(5, 2)])
    assert actions(decisions[1]) == [(Action.ADD, "prefill", Reason.PREFILL_QUEUE)]


def test_tpot_over_the_slo_or_full_kv_adds_a_decode_worker():
    slow = run(Planner(CONFIG), [snap(t, SPLIT, tpot=0.06) for t in every(5, 2)])
    assert actions(slow[1]) == [(Action.ADD, "decode", Reason.TPOT_OVER_SLO)]
    full = [worker("p0", "prefill"), worker("d0", "decode", kv_usage=0.95)]
    kv = run(Planner(CONFIG), [snap(t, full) for t in every(5, 2)])
    assert actions(kv[1]) == [(Action.ADD, "decode", Reason.KV_FULL)]


def test_both_objectives_broken_add_to_both_pools_at_once():
    decisions = run(Planner(CONFIG), [snap(t, SPLIT, ttft=2.0, tpot=0.1) for t in every(5, 2)])
    assert actions(decisions[1]) == [
        (Action.ADD, "prefill", Reason.TTFT_OVER_SLO),
        (Action.ADD, "decode", Reason.TPOT_OVER_SLO),
    ]


def test_a_mesh_of_both_workers_grows_by_both_workers():
    both = [worker("b0", "both"), worker("b1", "both")]
    decisions = run(Planner(CONFIG), [snap(t, both, ttft=2.0, tpot=0.1) for t in every(5, 2)])
    assert [(d.action, d.role) for d in decisions[1]] == [(Action.ADD, "both")]


def test_an_idle_side_with_objectives_met_drains_its_idlest_worker():
    mesh = [
        worker("p0", "prefill", busy=0.1),
        worker("p1", "prefill", busy=0.02),
        worker("d0", "decode", busy=0.6),
    ]
    decisions = run(Planner(CONFIG), [snap(t, mesh) for t in every(5, 2)])
    assert decisions[1] == [
        Decision(Action.DRAIN, Reason.PREFILL_IDLE, "prefill", "p1", decisions[1][0].detail)
    ]
    quiet = [worker("p0", "prefill"), worker("d0", "decode", busy=0.05, num_running=1)]
    quiet += [worker("d1", "decode", busy=0.05, num_running=0)]
    decisions = run(Planner(CONFIG), [snap(t, quiet) for t in every(5, 2)])
    assert [(d.action, d.worker_id, d.reason) for d in decisions[1]] == [
        (Action.DRAIN, "d1", Reason.DECODE_IDLE)
    ]


def test_no_drain_unless_both_objectives_are_measured_and_met_with_margin():
    mesh = [worker("p0", "prefill", busy=0.0), worker("p1", "prefill", busy=0.0)]
    mesh.append(worker("d0", "decode"))
    near = run(Planner(CONFIG), [snap(t, mesh, ttft=0.9) for t in every(5, 4)])  # > 0.8 s
    few = run(Planner(CONFIG), [snap(t, mesh, samples=4) for t in every(5, 4)])  # < 5 samples
    assert near == few == [[], [], [], []]


def test_bounds_hold_the_pools_between_min_and_max():
    at_max = [worker(f"p{i}", "prefill") for i in range(3)] + [worker("d0", "decode")]
    planner = Planner(CONFIG)
    assert run(planner, [snap(t, at_max, ttft=3.0) for t in every(5, 3)]) == [[], [], []]
    assert "at --planner-max-per-role" in planner.holding
    at_min = [worker("p0", "prefill", busy=0.0), worker("d0", "decode", busy=0.0)]
    planner = Planner(CONFIG)
    assert run(planner, [snap(t, at_min) for t in every(5, 3)]) == [[], [], []]
    assert "at --planner-min-per-role" in planner.holding
    none_kept = Planner(replace(CONFIG, min_per_role=0))
    decisions = run(none_kept, [snap(t, at_min) for t in every(5, 2)])
    assert [(d.action, d.worker_id) for d in decisions[1]] == [(Action.DRAIN, "p0")]


def test_a_need_that_does_not_hold_in_a_row_never_acts():
    late, fine = snap(0, SPLIT, ttft=1.5), snap(0, SPLIT, ttft=0.5)
    series = [replace(s, now=t) for s, t in zip([late, fine] * 4, every(5, 8), strict=True)]
    assert run(Planner(CONFIG), series) == [[]] * 8


def test_cooldown_then_the_need_must_hold_again():
    planner = Planner(CONFIG)
    grown = [*SPLIT, worker("p1", "prefill")]
    series = [snap(0, SPLIT, ttft=1.5), snap(5, SPLIT, ttft=1.5)]  # → ADD prefill at 5 s
    series += [snap(t, grown, ttft=1.5) for t in every(5, 8, start=10)]  # 10 .. 45 s
    decided = [s.now for s, d in zip(series, run(planner, series), strict=True) if d]
    assert decided == [5.0, 40.0]  # 35 s is the first after the cooldown; it must hold twice


def test_the_planner_waits_to_see_its_decision_take_effect_up_to_settle():
    planner = Planner(replace(CONFIG, cooldown=0.0))
    series = [snap(t, SPLIT, tpot=0.1) for t in every(5, 2)]  # → ADD decode at 5 s
    series += [snap(t, SPLIT, tpot=0.1) for t in every(5, 30, start=10)]  # it never joins
    decided = [s.now for s, d in zip(series, run(planner, series), strict=True) if d]
    assert decided == [5.0, 130.0]  # settle (120 s) ends the wait at 125 s; hold: 130 s


def test_a_new_worker_joining_ends_the_wait_at_once():
    planner = Planner(replace(CONFIG, cooldown=0.0))
    grown = [*SPLIT, worker("d1", "decode")]
    series = [snap(t, SPLIT, tpot=0.1) for t in every(5, 2)]
    series += [snap(10, SPLIT, tpot=0.1)] + [snap(t, grown, tpot=0.1) for t in every(5, 2, 15)]
    decisions = run(planner, series)
    assert [bool(d) for d in decisions] == [False, True, False, False, True]


def test_not_taken_stops_the_wait_for_a_decision_that_did_not_start():
    planner = Planner(replace(CONFIG, cooldown=0.0))
    run(planner, [snap(t, SPLIT, tpot=0.1) for t in every(5, 2)])
    planner.not_taken()
    decisions = run(planner, [snap(t, SPLIT, tpot=0.1) for t in every(5, 2, start=10)])
    assert [bool(d) for d in decisions] == [False, True]


def test_nothing_is_decided_while_a_worker_changes_role_and_the_streak_restarts():
    changing = [worker("p0", "prefill"), worker("d0", "decode", next_role="both")]
    series = [snap(0, SPLIT, ttft=2.0), snap(5, changing, ttft=2.0), snap(10, SPLIT, ttft=2.0)]
    planner = Planner(CONFIG)
    assert run(planner, series) == [[], [], []]  # the change cleared the first snapshot's count
    assert "1/2 snapshots" in planner.holding
    assert planner.decide(snap(15, SPLIT, ttft=2.0)) != []


def test_the_same_snapshots_give_the_same_decisions():
    mesh = [worker("p0", "prefill", busy=0.05), worker("p1", "prefill", busy=0.1)]
    mesh += [worker("d0", "decode", kv_usage=0.5)]
    series = [snap(t, mesh, ttft=1.0 + (t % 3) / 2, tpot=0.03) for t in every(5, 40)]
    assert run(Planner(CONFIG), series) == run(Planner(CONFIG), series)


def test_counts_leave_draining_workers_out_and_count_a_change_for_its_new_role():
    signals = snap(
        0,
        [
            worker("p0", "prefill", draining=True),
            worker("d0", "decode", next_role="both"),
            worker("d1", "decode"),
        ],
    )
    assert live_counts(signals) == RoleCounts(prefill=0, decode=1, both=1)
    moved = Decision(Action.SET_ROLE, Reason.TTFT_OVER_SLO, "prefill", "d1")
    added = Decision(Action.ADD, Reason.KV_FULL, "decode")
    assert counts_after(signals, [moved, added]) == RoleCounts(prefill=1, decode=1, both=1)


@pytest.mark.parametrize(
    "changes",
    [{"mode": "both"}, {"hold": 0}, {"margin": 1.5}, {"min_per_role": 3, "max_per_role": 2}],
)
def test_a_config_that_cannot_work_is_refused(changes):
    from shared.errors import ConfigError

    with pytest.raises(ConfigError):
        PlannerConfig(**changes)
