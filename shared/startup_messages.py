"""The start-up report a worker's heartbeats carry (Heartbeat.startup): seconds per phase
of its start (shared/engine/startup_phases.py names them), in phase order.

The subtle rule: the first step's phase appears only once that step ran, so a report
without it is a worker that has served nothing yet, not one whose first step was free.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.startup_phases import StartupPhase


@dataclass(slots=True)
class PhaseTime:
    phase: StartupPhase
    seconds: float
