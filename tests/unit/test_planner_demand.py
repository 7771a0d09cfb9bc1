"""The planner's needs from demand (`--planner-signals demand`): prompt work and streams in
flight against the rates the workers measured; roles mode moves workers toward the split of
least pressure, at once and not from windowed p99s; the decode side's capacity comes from
the fitted row cost; a mesh that is not split, or has measured nothing, is left to the
latency rules. And the worker's row-cost fit itself."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.planner.decision import Action, Reason
from services.planner.demand import mesh_demand, streams_within
from services.planner.policy import Planner
from services.worker.step_costs import StepTimer
from tests.unit.planner_signals import CONFIG, every, run, snap, worker

# Objectives 4 s / 50 ms (margin 0.8: 3.2 s, 40 ms); a decode step of 20 ms fixed + 5 ms a row
# holds (40 - 20) / 5 = 4 streams; one prefill worker computes 1000 prompt tokens a second.
DEMAND = replace(CONFIG, mode="roles", signals="demand", ttft_slo=4.0, tpot_slo=0.05)
STEP = {"decode_step_s": 0.030, "decode_batch": 2.0, "decode_row_s": 0.005}


def prefill(worker_id: str, busy: float, queued: int = 0):
    return worker(worker_id, "prefill", busy=busy, queued_prompt_tokens=queued, num_running=0)


def decode(worker_id: str, streams: int):
    return worker(worker_id, "decode", num_running=streams, busy=0.5, **STEP)


def test_streams_within_the_objective_from_the_fitted_row_cost():
    assert streams_within(decode("d0", 2), DEMAND) == pytest.approx(4.0)
    unfitted = replace(decode("d0", 2), decode_row_s=0.0)  # step / rows: 15 ms a row, no fixed
    assert streams_within(unfitted, DEMAND) == pytest.approx(0.040 / 0.015)
    slow = replace(decode("d0", 2), decode_step_s=0.060)  # fixed 50 ms: past the objective
    assert streams_within(slow, DEMAND) == 1.0
    assert streams_within(replace(decode("d0", 2), decode_step_s=0.0), DEMAND) == 0.0


def test_a_burst_of_long_prompts_takes_decode_workers_at_once():
    """Two prefill workers busy with 12 800 queued prompt tokens (4 s of work at 1000 tokens
    a second each against 3.2 s), six decode workers with 5 streams among them: prefill
    need 2 + 12800 / 3200 = 6, decode need 1.25; the best split of 8 is 6 + 2 (pressure 1.0
    against 3.0), so 4 move, capped at max_moves (2), the decode workers with fewest
    streams first, on the second snapshot (hold 2) with no latency sample at all."""
    mesh = [prefill("p0", 1.0, 6400), prefill("p1", 1.0, 6400)]
    mesh += [decode(f"d{i}", 1 if i < 5 else 0) for i in range(6)]
    demand = mesh_demand(snap(0, mesh), DEMAND)
    assert demand is not None and demand.best_prefill_workers() == 6
    decisions = run(Planner(DEMAND), [snap(t, mesh, samples=0) for t in every(5, 2)])
    assert decisions[0] == []
    assert {d.worker_id for d in decisions[1]} == {"d5", "d0"}
    assert {(d.action, d.role, d.reason) for d in decisions[1]} == {
        (Action.SET_ROLE, "prefill", Reason.PREFILL_DEMAND)
    }


def test_many_streams_take_idle_prefill_workers():
    """Four prefill workers 10% busy, four decode workers with 24 streams (6 each against 4
    within the objective): decode need 6, prefill need 0.4; the split 2 + 6 (pressure 1.0
    against 1.5) moves the two idlest prefill workers."""
    mesh = [prefill(f"p{i}", 0.1 + i / 100) for i in range(4)]
    mesh += [decode(f"d{i}", 6) for i in range(4)]
    decisions = run(Planner(DEMAND), [snap(t, mesh, samples=0) for t in every(5, 2)])
    assert {(d.worker_id, d.role) for d in decisions[1]} == {("p0", "decode"), ("p1", "decode")}
    assert {d.reason for d in decisions[1]} == {Reason.DECODE_DEMAND}


def test_a_mesh_within_its_capacity_or_gaining_little_keeps_its_split():
    light = [prefill("p0", 0.3), prefill("p1", 0.3), decode("d0", 2), decode("d1", 2)]
    planner = Planner(DEMAND)
    assert run(planner, [snap(t, light) for t in every(5, 3)]) == [[]] * 3
    # decode over capacity (pressure 1.25) but a prefill worker moved would leave prompts at
    # 0.95 / 1 > 0.75 x 1.25: not worth the move
    close = [prefill("p0", 0.95), prefill("p1", 0.95), decode("d0", 5), decode("d1", 5)]
    assert run(Planner(DEMAND), [snap(t, close) for t in every(5, 3)]) == [[]] * 3


def test_an_unsplit_or_unmeasured_mesh_falls_back_to_the_latency_rules():
    both = [worker("b0", "both", num_running=3), worker("b1", "both", num_running=1)]
    decisions = run(Planner(DEMAND), [snap(t, both, tpot=0.08) for t in every(5, 2)])
    assert {d.reason for d in decisions[1]} == {Reason.TPOT_OVER_SLO}  # the latency rule splits
    unmeasured = [prefill("p0", 1.0, 50_000), replace(decode("d0", 9), decode_step_s=0.0)]
    unmeasured.append(replace(decode("d1", 9), decode_step_s=0.0))
    assert mesh_demand(snap(0, unmeasured), DEMAND) is None


def test_replicas_mode_adds_a_worker_to_a_side_past_its_capacity():
    mesh = [prefill("p0", 1.0, 6400), decode("d0", 2)]
    config = replace(DEMAND, mode="replicas")
    decisions = run(Planner(config), [snap(t, mesh, samples=0) for t in every(5, 2)])
    assert [(d.action, d.role, d.reason) for d in decisions[1]] == [
        (Action.ADD, "prefill", Reason.PREFILL_DEMAND)
    ]


def test_the_worker_fits_the_row_cost_of_decode_steps():
    """Steps of 20 ms + 5 ms a row at 1..8 rows give a slope of 5 ms; steps that all had
    the same rows give none (0: not fitted); prompt steps do not count."""
    timer = StepTimer()
    for i in range(2000):
        rows = 1 + i % 8
        timer.observe(0.020 + 0.005 * rows, 0, rows)
        timer.observe(0.5, 256, rows)  # a prompt step: no decode-step sample
    assert timer.current.decode_row_s == pytest.approx(0.005, rel=1e-3)
    flat = StepTimer()
    for _ in range(500):
        flat.observe(0.030, 0, 4)
    assert flat.current.decode_row_s == 0.0
