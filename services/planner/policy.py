"""The planner's policy: `Planner(config).decide(signals)` → the decisions for one snapshot.

Each call, in order (the first that applies ends it, with `holding` saying why):
  1. no worker in the snapshot, or neither a latency sample nor any load: NO_SIGNAL, hold
  2. a worker in the middle of a role change: hold (never decide on a mesh mid-change)
  3. the last decision's effect not visible yet (the counts it expects, needs.py's
     counting) and less than `settle` seconds since: hold
  4. less than `cooldown` seconds since the last decision: hold
  5. the needs of this snapshot (needs.py; with `signals` demand, demand.py's where the mesh
     is split and has measured its rates). A need acts once it has shown in `hold`
     snapshots in a row; until then, or when there is none, hold.
  6. the mode (modes.py) meets the needs that held: in `replicas` mode each of them (an ADD
     per pool at most, and a DRAIN only when nothing is to be added, the prefill side's
     first); in `roles` mode only the one with the most pressure that it can meet (TPOT at
     1.5x its objective outweighs TTFT at 1.2x): one set of workers cannot move two ways.
Any hold but 5's clears the streaks, so a need counts only the snapshots the planner could
have acted on. Rules per mode, their thresholds and an example: docs/planner.md.

The subtle rule: the policy is pure. Its clock is `signals.now`, its only state the
streaks, the time of its last decision and the counts that decision expects; the same
snapshots give the same decisions in the service, the simulator and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.config import PlannerConfig
from services.planner.counts import RoleCounts, counts_after, live_counts
from services.planner.decision import Decision, Reason
from services.planner.demand import demand_needs
from services.planner.modes import replica_actions, role_actions
from services.planner.needs import Need, NeedKind, needs
from services.planner.signals import MeshSignals

NO_SIGNAL = Reason.NO_SIGNAL


@dataclass(frozen=True, slots=True)
class Expected:
    counts: RoleCounts  # what the mesh should count once the decision took effect
    since: float  # signals.now of the decision


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self.holding = ""  # why the last call decided nothing ("" when it decided)
        self.hold_reason: Reason | None = None  # NO_SIGNAL when that was the why
        self._streaks: dict[NeedKind, int] = {}
        self._last_decision = float("-inf")
        self._expected: Expected | None = None

    def decide(self, signals: MeshSignals) -> list[Decision]:
        self.holding, self.hold_reason = "", None
        if why := self._why_wait(signals):
            self._streaks.clear()
            return self._hold(why)
        found = self._needs(signals)
        self._streaks = {n.kind: self._streaks.get(n.kind, 0) + 1 for n in found}
        ready = [n for n in found if self._streaks[n.kind] >= self.config.hold]
        if not ready:
            return self._hold(_waiting(found, self._streaks, self.config.hold))
        decisions, why_not = self._act(ready, signals)
        if not decisions:
            return self._hold(why_not)
        self._streaks.clear()
        self._last_decision = signals.now
        self._expected = Expected(counts_after(signals, decisions), signals.now)
        return decisions

    def _needs(self, signals: MeshSignals) -> list[Need]:
        if self.config.signals == "demand":
            found = demand_needs(signals, self.config)
            if found is not None:
                return found
        return needs(signals, self.config)

    def not_taken(self) -> None:
        """The actor says the last decision did not start (a worker refused its SetRole):
        the mesh will not show it, so do not wait for it (the cooldown still runs)."""
        self._expected = None

    def _why_wait(self, s: MeshSignals) -> str:
        if not s.workers:
            self.hold_reason = NO_SIGNAL
            return "no signal: no worker has reported"
        loaded = any(w.num_running or w.num_waiting or w.queued_prompt_tokens for w in s.workers)
        if not (s.ttft_samples or s.tpot_samples or loaded):
            self.hold_reason = NO_SIGNAL
            return "no signal: no request measured in the window and none in flight"
        if changing := sorted(w.worker_id for w in s.workers if w.next_role):
            return f"worker {', '.join(changing)} in the middle of a role change"
        if self._expected is not None:
            expected, live = self._expected, live_counts(s)
            if live != expected.counts and s.now < expected.since + self.config.settle:
                return f"waiting for the mesh to count {expected.counts} (now {live})"
            self._expected = None
        if s.now < self._last_decision + self.config.cooldown:
            return f"cooling down for {self._last_decision + self.config.cooldown - s.now:.0f} s"
        return ""

    def _act(self, ready: list[Need], signals: MeshSignals) -> tuple[list[Decision], str]:
        if self.config.mode == "roles":
            why_not = []
            for need in sorted(ready, key=lambda n: (-n.pressure, n.kind)):
                made, why = role_actions(need, signals, self.config)
                if made:
                    return made, ""
                why_not.append(why)
            return [], "; ".join(why_not)
        adds = [n for n in ready if n.kind in (NeedKind.MORE_PREFILL, NeedKind.MORE_DECODE)]
        decisions: list[Decision] = []
        why_not: list[str] = []
        for need in adds or sorted(ready, key=lambda n: n.kind):
            made, why = replica_actions(need, signals, self.config)
            if any(d.action is m.action and d.role == m.role for d in decisions for m in made):
                continue  # a mesh of both workers: one ADD both meets both needs
            decisions += made
            why_not += [why] if why else []
            if made and not adds:
                break  # one DRAIN at a time
        return decisions, "; ".join(why_not)

    def _hold(self, why: str) -> list[Decision]:
        self.holding = why
        return []


def _waiting(found: list[Need], streaks: dict[NeedKind, int], hold: int) -> str:
    if not found:
        return "objectives met, no side idle"
    return "; ".join(f"{n.detail} ({streaks[n.kind]}/{hold} snapshots)" for n in found)
