"""How each mode meets a need (needs.py) with decisions on one snapshot.

replicas (ADD and DRAIN, within `min_per_role`..`max_per_role` workers of each role):
  MORE_PREFILL  ADD prefill (both, in a mesh of both workers only)
  MORE_DECODE   ADD decode (both, likewise)
  LESS_PREFILL  DRAIN the idlest prefill worker
  LESS_DECODE   DRAIN the decode worker with the fewest streams (both, likewise)
roles (SET_ROLE among the workers there are, e.g. `up --pool` pinned to cores):
  a need from demand (demand.py) names how many workers move: decode workers with the
  fewest streams → prefill, or the idlest prefill workers → decode. Otherwise:
  MORE_DECODE   TPOT over the SLO while prompts arrive and some worker does both: split.
                With a prefill worker already, the both workers → decode; else half the
                mesh (both workers with the fewest streams first) → prefill, the rest →
                decode, in one decision (both+both → prefill+decode; 8 both → 4 + 4: a
                split a step at a time would send every long prompt to one prefill worker).
                Otherwise, with two prefill workers or more, the idlest → decode when
                the others' busy shares over one worker fewer stay within `margin`.
  MORE_PREFILL  decode workers but one (fewest streams first) → prefill, as many as leave
                the decode side's TPOT p99, scaled by its workers before / after, within
                margin x its objective (none: hold, the decode side cannot spare any). A
                mesh of one decode worker and at most `max_moves` in all merges: every worker
                → both (under the fixed path rule a both worker prefills long prompts only
                when no prefill worker is left); else the one decode worker → both.
  LESS_PREFILL  nothing: an idle prefill side keeps its workers till decode needs them (one
                moved away is missing at the next burst of long prompts)
  LESS_DECODE   nothing: fixed hardware has nothing to give back
In roles mode at most `--planner-max-moves` (2) workers change per decision but for the
split, which moves the whole mesh at once.
The subtle rule: no decision leaves the mesh without a worker that decodes (decode or
both), and no two decisions name the same worker. A need the mode cannot meet says why.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    """The role changes for `need`: a split of both workers whole, any other change at most
    `config.max_moves` workers, in the order below."""
    made, why, whole = _role_changes(need, signals, config)
    return (made if whole else made[: config.max_moves]), why


def _role_changes(
    need: Need, signals: MeshSignals, config: PlannerConfig
) -> tuple[list[Decision], str, bool]:
    max_moves = config.max_moves
    prefill, decode, both = (side(signals, (r,)).workers for r in ("prefill", "decode", "both"))

    def to(role: str, workers: Sequence[WorkerSignal]) -> list[Decision]:
        reason, detail = need.reason, need.detail
        return [Decision(Action.SET_ROLE, reason, role, w.worker_id, detail) for w in workers]

    if need.moves:  # from demand: this many workers, the ones that give up least
        if need.kind is NeedKind.MORE_PREFILL:
            return to("prefill", sorted(decode, key=_streams_order)[: need.moves]), "", False
        return to("decode", sorted(prefill, key=_idle_order)[: need.moves]), "", False
    if need.kind is NeedKind.MORE_DECODE:
        prompts = signals.ttft_samples > 0 or any(w.queued_prompt_tokens for w in both)
        if need.reason is Reason.TPOT_OVER_SLO and both and prompts:
            ordered = sorted(both, key=_streams_order)
            if prefill:
                return to("decode", ordered), "", False
            if len(both) >= 2 or decode:  # the split, whole: half the mesh prefills
                k = min(len(both), max(1, (len(both) + len(decode)) // 2))
                return to("prefill", ordered[:k]) + to("decode", ordered[k:]), "", True
        if len(prefill) >= 2:
            busy = sum(w.busy for w in prefill) / (len(prefill) - 1)
            if busy > config.margin:
                return [], f"the prefill side cannot spare a worker: {busy:.0%} busy after", False
            return to("decode", [_idlest(prefill)]), "", False
        return [], "no worker can move to decode and leave prompts a worker to prefill them", False
    if need.kind is NeedKind.MORE_PREFILL:
        if len(decode) >= 2:  # keep one: the fewest streams move, as many as decode spares
            spares = [
                k for k in range(1, len(decode)) if _tpot_after(signals, len(decode), k, config)
            ]
            if not spares:
                tpot = signals.tpot_p99 * 1e3
                return [], f"the decode side cannot spare a worker (TPOT p99 {tpot:.1f} ms)", False
            return to("prefill", sorted(decode, key=_streams_order)[: spares[-1]]), "", False
        if decode and not both and len(prefill) + 1 <= max_moves:  # small: merge it whole
            return to("both", [*prefill, *decode]), "", False
        if decode:  # it prefills its own requests too, as the path choice gives them
            return to("both", decode), "", False
        return [], "every worker that decodes prefills already", False
    if need.kind is NeedKind.LESS_PREFILL:
        return (
            [],
            "roles mode: an idle prefill side keeps its workers till decode needs them",
            False,
        )
    return [], "roles mode: an idle decode side keeps its workers", False


def _tpot_after(signals: MeshSignals, decoders: int, moved: int, config: PlannerConfig) -> bool:
    """Does the decode side keep its objective (margin x) when `moved` of its `decoders`
    leave? TPOT p99 taken to grow as the streams spread over fewer workers; no sample: yes."""
    limit = config.margin * config.tpot_slo
    return not signals.tpot_samples or signals.tpot_p99 * decoders / (decoders - moved) <= limit


def _decodes_after(counts: RoleCounts, drained: str) -> bool:
    """Is a worker that decodes left once one of `drained` leaves?"""
    return counts.moved(drained, -1).decoders >= 1


def _idle_order(w: WorkerSignal) -> tuple[float, int, int, str]:
    return (w.busy, w.queued_prompt_tokens, w.num_running, w.worker_id)


def _idlest(workers: Sequence[WorkerSignal]) -> WorkerSignal:
    return min(workers, key=_idle_order)


def _streams_order(w: WorkerSignal) -> tuple[int, float, float, str]:
    return (w.num_running, w.kv_usage, w.busy, w.worker_id)


def _fewest_streams(workers: Sequence[WorkerSignal]) -> WorkerSignal:
    return min(workers, key=_streams_order)
