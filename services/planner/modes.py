"""How each mode meets a need (needs.py) with decisions on one snapshot.

replicas (ADD and DRAIN, within `min_per_role`..`max_per_role` workers of each role):
  MORE_PREFILL  ADD prefill (both, in a mesh of both workers only)
  MORE_DECODE   ADD decode (both, likewise)
  LESS_PREFILL  DRAIN the idlest prefill worker
  LESS_DECODE   DRAIN the decode worker with the fewest streams (both, likewise)
roles (SET_ROLE among the workers there are, e.g. `up --pool` pinned to cores):
  MORE_DECODE   TPOT over the SLO while prompts arrive and some worker does both: split.
                With a prefill worker already, every both worker → decode; else the both
                worker with the fewest streams → prefill and the others → decode
                (both+both → prefill+decode). Otherwise, with two prefill workers or more,
                the idlest → decode.
  MORE_PREFILL  the decode worker with the fewest streams → both (it prefills its own
                requests too; the scheduler's path choice decides which)
  LESS_PREFILL  merge: every prefill and decode worker → both (prefill+decode → both+both)
  LESS_DECODE   nothing: fixed hardware has nothing to give back
In roles mode at most `--planner-max-moves` (2) workers change per decision, the first of
the list above first (the prefill worker of a split, then those with the fewest streams), so
a large mesh moves a step at a time and the next snapshot can pull the other way.
The subtle rule: no decision leaves the mesh without a worker that decodes (decode or
both), and no two decisions name the same worker. A need the mode cannot meet says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import zip_longest

from services.planner.config import PlannerConfig
from services.planner.counts import RoleCounts, live_counts
from services.planner.decision import Action, Decision, Reason
from services.planner.needs import Need, NeedKind, side
from services.planner.signals import MeshSignals, WorkerSignal

Outcome = tuple[list[Decision], str]  # the decisions, or why there are none


def replica_actions(need: Need, signals: MeshSignals, config: PlannerConfig) -> Outcome:
    counts = live_counts(signals)
    if need.kind in (NeedKind.MORE_PREFILL, NeedKind.MORE_DECODE):
        pool = "prefill" if need.kind is NeedKind.MORE_PREFILL else "decode"
        role = pool if counts.split else "both"
        if counts.of(role) >= config.max_per_role:
            return [], f"{role} has {counts.of(role)} workers: at --planner-max-per-role"
        return [Decision(Action.ADD, need.reason, role, detail=need.detail)], ""
    if need.kind is NeedKind.LESS_PREFILL:
        role, pick = "prefill", _idlest
    else:
        role, pick = ("decode" if counts.decode else "both"), _fewest_streams
    workers = side(signals, (role,)).workers
    if len(workers) <= config.min_per_role or not _decodes_after(counts, role):
        return [], f"{role} has {len(workers)} workers: at --planner-min-per-role"
    worker = pick(workers)
    return [Decision(Action.DRAIN, need.reason, role, worker.worker_id, need.detail)], ""


def role_actions(need: Need, signals: MeshSignals, config: PlannerConfig) -> Outcome:
    """The role changes for `need`, at most `config.max_moves` of them, in the order below."""
    made, why = _role_changes(need, signals)
    return made[: config.max_moves], why


def _role_changes(need: Need, signals: MeshSignals) -> Outcome:
    prefill, decode, both = (side(signals, (r,)).workers for r in ("prefill", "decode", "both"))

    def to(role: str, workers: Sequence[WorkerSignal]) -> list[Decision]:
        reason, detail = need.reason, need.detail
        return [Decision(Action.SET_ROLE, reason, role, w.worker_id, detail) for w in workers]

    if need.kind is NeedKind.MORE_DECODE:
        prompts = signals.ttft_samples > 0 or any(w.queued_prompt_tokens for w in both)
        if need.reason is Reason.TPOT_OVER_SLO and both and prompts:
            if prefill:
                return to("decode", sorted(both, key=_streams_order)), ""
            if len(both) >= 2 or decode:
                first = _fewest_streams(both)
                rest = sorted((w for w in both if w is not first), key=_streams_order)
                return to("prefill", [first]) + to("decode", rest), ""
        if len(prefill) >= 2:
            return to("decode", [_idlest(prefill)]), ""
        return [], "no worker can move to decode and leave prompts a worker to prefill them"
    if need.kind is NeedKind.MORE_PREFILL:
        if decode:
            return to("both", [_fewest_streams(decode)]), ""
        return [], "every worker that decodes prefills already"
    if need.kind is NeedKind.LESS_PREFILL:  # a prefill and a decode worker at a time
        pairs = zip_longest(sorted(prefill, key=_streams_order), sorted(decode, key=_streams_order))
        return to("both", [w for pair in pairs for w in pair if w is not None]), ""
    return [], "roles mode: an idle decode side keeps its workers"


def _decodes_after(counts: RoleCounts, drained: str) -> bool:
    """Is a worker that decodes left once one of `drained` leaves?"""
    return counts.moved(drained, -1).decoders >= 1


def _idlest(workers: Sequence[WorkerSignal]) -> WorkerSignal:
    return min(workers, key=lambda w: (w.busy, w.queued_prompt_tokens, w.num_running, w.worker_id))


def _streams_order(w: WorkerSignal) -> tuple[int, float, float, str]:
    return (w.num_running, w.kv_usage, w.busy, w.worker_id)


def _fewest_streams(workers: Sequence[WorkerSignal]) -> WorkerSignal:
    return min(workers, key=_streams_order)
