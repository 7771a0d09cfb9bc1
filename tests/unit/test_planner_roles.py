"""The planner's roles mode on recorded signal sequences: the fixed workers of `up --pool`
change roles (split when streams are slow, a decode worker takes prompts too when first
tokens are late), only as far as the side that gives workers keeps its objective, never
leaving the mesh without a worker that decodes, and never adding or draining one; an idle
side keeps its workers (fixed hardware has nothing to give back)."""

from __future__ import annotations

from dataclasses import replace

from services.planner.counts import counts_after
from services.planner.decision import Action, Reason
from services.planner.policy import Planner
from tests.unit.planner_signals import CONFIG, every, run, snap, worker

ROLES = replace(CONFIG, mode="roles")


def moves(decisions) -> dict[str, str]:
    assert all(d.action is Action.SET_ROLE for d in decisions)
    return {d.worker_id: d.role for d in decisions}


def test_slow_streams_beside_prompts_split_two_both_workers():
    mesh = [worker("b0", "both", num_running=3), worker("b1", "both", num_running=1)]
    decisions = run(Planner(ROLES), [snap(t, mesh, tpot=0.08) for t in every(5, 2)])
    assert decisions[0] == []
    assert moves(decisions[1]) == {"b1": "prefill", "b0": "decode"}  # fewer streams: prefill
    assert {d.reason for d in decisions[1]} == {Reason.TPOT_OVER_SLO}


def test_with_a_prefill_worker_already_the_both_workers_turn_decode():
    mesh = [worker("p0", "prefill"), worker("b0", "both"), worker("b1", "both")]
    decisions = run(Planner(ROLES), [snap(t, mesh, tpot=0.08) for t in every(5, 2)])
    assert moves(decisions[1]) == {"b0": "decode", "b1": "decode"}


def test_a_large_mesh_splits_whole_and_then_moves_a_step_at_a_time():
    """Eight both workers with slow streams split in one decision, half to prefill (the
    fewest streams first): a split a step at a time would send every long prompt to one
    prefill worker. Other changes move at most `max_moves` workers, and late first tokens
    take only the decode workers whose streams the others can carry within the TPOT
    objective (p99 20 ms over 4 workers: 26.7 ms over 3 is within 0.8 x 40, 40 over 2 not)."""
    mesh = [worker(f"b{i}", "both", num_running=i) for i in range(8)]
    decisions = run(Planner(ROLES), [snap(t, mesh, tpot=0.08) for t in every(5, 2)])
    halves = {f"b{i}": "prefill" if i < 4 else "decode" for i in range(8)}
    assert moves(decisions[1]) == halves
    late = [worker(f"d{i}", "decode", num_running=4 - i) for i in range(4)]
    late.append(worker("p0", "prefill"))
    decisions = run(Planner(ROLES), [snap(t, late, ttft=3.0) for t in every(5, 2)])
    assert moves(decisions[1]) == {"d3": "prefill"}
    decisions = run(Planner(ROLES), [snap(t, late, ttft=3.0, tpot=0.01) for t in every(5, 2)])
    assert moves(decisions[1]) == {"d3": "prefill", "d2": "prefill"}  # max_moves of three


def test_one_worker_alone_is_never_split():
    planner = Planner(ROLES)
    alone = [worker("b0", "both")]
    assert run(planner, [snap(t, alone, tpot=0.08) for t in every(5, 4)]) == [[]] * 4
    assert "no worker can move to decode" in planner.holding


def test_slow_streams_without_prompts_arriving_split_nothing():
    mesh = [worker("b0", "both"), worker("b1", "both")]
    series = [replace(snap(t, mesh, tpot=0.08), ttft_samples=0) for t in every(5, 3)]
    assert run(Planner(ROLES), series) == [[]] * 3


def test_late_first_tokens_move_a_decode_worker_to_prefill_or_merge_a_small_split():
    mesh = [worker("p0", "prefill"), worker("d0", "decode", num_running=4)]
    mesh.append(worker("d1", "decode", num_running=1))
    decisions = run(Planner(ROLES), [snap(t, mesh, ttft=1.8, tpot=0.012) for t in every(5, 2)])
    assert moves(decisions[1]) == {"d1": "prefill"}
    assert decisions[1][0].reason is Reason.TTFT_OVER_SLO
    # d0 alone would carry both decode workers' streams: 2 x 20 ms > 0.8 x 40 ms
    planner = Planner(ROLES)
    assert run(planner, [snap(t, mesh, ttft=1.8) for t in every(5, 2)]) == [[], []]
    assert "the decode side cannot spare a worker (TPOT p99 20.0 ms)" in planner.holding
    pair = [worker("p0", "prefill"), worker("d0", "decode", num_running=4)]
    decisions = run(Planner(ROLES), [snap(t, pair, ttft=1.8) for t in every(5, 2)])
    assert moves(decisions[1]) == {"p0": "both", "d0": "both"}


def test_an_idle_prefill_side_keeps_its_workers_till_decode_needs_them():
    """Moving an idle prefill worker buys nothing on fixed hardware, and the next burst of
    long prompts would find it gone (the simulator's shift workload: 82% against 93%)."""
    for mesh in (
        [worker("p0", "prefill", busy=0.05), worker("d0", "decode", busy=0.3)],
        [worker(f"p{i}", "prefill", busy=0.05) for i in range(3)] + [worker("d0", "decode")],
    ):
        planner = Planner(ROLES)
        assert run(planner, [snap(t, mesh) for t in every(5, 3)]) == [[]] * 3
        assert "an idle prefill side keeps its workers" in planner.holding


def test_an_idle_decode_side_keeps_its_workers():
    mesh = [worker("b0", "both", busy=0.05), worker("b1", "both", busy=0.05)]
    planner = Planner(ROLES)
    assert run(planner, [snap(t, mesh) for t in every(5, 3)]) == [[]] * 3
    assert "keeps its workers" in planner.holding


def test_two_broken_objectives_move_workers_the_way_that_is_further_off():
    mesh = [worker(f"p{i}", "prefill", busy=0.3) for i in range(2)] + [worker("d0", "decode")]
    # TPOT at 2x its objective outweighs TTFT at 1.2x: a prefill worker goes to decode (the
    # other can take its prompts: 60% busy).
    decisions = run(Planner(ROLES), [snap(t, mesh, ttft=1.2, tpot=0.08) for t in every(5, 2)])
    assert [(d.role, d.reason) for d in decisions[1]] == [("decode", Reason.TPOT_OVER_SLO)]
    busy = [worker(f"p{i}", "prefill", busy=0.5) for i in range(2)] + [worker("d0", "decode")]
    planner = Planner(ROLES)
    decisions = run(planner, [snap(t, busy, ttft=0.3, tpot=0.08) for t in every(5, 2)])
    assert decisions == [[], []]
    assert "the prefill side cannot spare a worker: 100% busy after" in planner.holding
    # TTFT at 3x outweighs TPOT at 1.25x: the decode worker takes prompts too.
    decisions = run(Planner(ROLES), [snap(t, mesh, ttft=3.0, tpot=0.05) for t in every(5, 2)])
    assert moves(decisions[1]) == {"d0": "both"}


def test_roles_mode_never_leaves_the_mesh_without_a_decoding_worker():
    meshes = [
        [worker("b0", "both")],
        [worker("p0", "prefill"), worker("d0", "decode")],
        [worker("p0", "prefill"), worker("b0", "both")],
        [worker("b0", "both"), worker("b1", "both"), worker("d0", "decode")],
        [worker("p0", "prefill", busy=0.0), worker("d0", "decode", busy=0.0)],
    ]
    figures = [(2.0, 0.02), (0.3, 0.08), (2.0, 0.08), (0.3, 0.02)]
    for mesh in meshes:
        for ttft, tpot in figures:
            series = [snap(t, mesh, ttft=ttft, tpot=tpot) for t in every(5, 3)]
            for signals, decisions in zip(series, run(Planner(ROLES), series), strict=True):
                assert all(d.action is Action.SET_ROLE for d in decisions)
                assert len({d.worker_id for d in decisions}) == len(decisions)
                assert counts_after(signals, decisions).decoders >= 1


def test_when_the_further_need_cannot_move_anyone_the_other_one_acts():
    mesh = [worker("b0", "both", num_running=1), worker("b1", "both", num_running=3)]
    # TTFT at 3x (no decode worker can take prompts: all do already), TPOT at 1.5x: split.
    decisions = run(Planner(ROLES), [snap(t, mesh, ttft=3.0, tpot=0.06) for t in every(5, 2)])
    assert moves(decisions[1]) == {"b0": "prefill", "b1": "decode"}
