"""A worker's start, timed phase by phase from its process's start to serving
(shared/engine/startup_phases.py names the phases; the engine times its own).

Reported three ways: a log line once it serves (and one for its first step), the gauge
`splitserve_worker_startup_seconds{phase}` (`phase="ready"`: the whole start) and every
heartbeat (`Heartbeat.startup`, `Heartbeat.ready_s`). The subtle rule: the process's start
is the kernel's record of it (/proc/self/stat), not the moment Python ran its first line,
so `imports` holds the interpreter's own start too (a standby's: its hand-off, whose
imports were done before it).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from services.standby import HANDED_OFF_AT_ENV
from shared.engine.startup_phases import PhaseClock, StartupPhase
from shared.startup_messages import PhaseTime

log = logging.getLogger(__name__)
P = StartupPhase


def process_age() -> float:
    """Seconds since this process started (0.0 where /proc does not say); for a standby
    handed this worker (services/standby.py), since the hand-off."""
    if handed_off_at := os.environ.get(HANDED_OFF_AT_ENV):
        return max(0.0, time.time() - float(handed_off_at))
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return 0.0
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; after comm
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartupReport:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.clock = PhaseClock()
        self.ready_s = 0.0  # process start → serving; 0 until then
        self._gauge = Gauge(
            "splitserve_worker_startup_seconds",
            "Seconds of the worker's start per phase; phase=ready: process start to serving",
            ["phase"],
            registry=registry,
        )

    def imported(self) -> None:
        self.clock.add(P.IMPORTS, process_age())

    def engine_started(self, engine_phases: dict[StartupPhase, float], seconds: float) -> None:
        """The engine's start took `seconds`, of which it timed `engine_phases` itself."""
        for phase, spent in engine_phases.items():
            self.clock.add(phase, spent)
        self.clock.add(P.ENGINE_REST, max(0.0, seconds - sum(engine_phases.values())))

    def ready(self) -> None:
        self.ready_s = process_age()
        for phase, seconds in self.clock.seconds.items():
            self._gauge.labels(phase.name.lower()).set(seconds)
        self._gauge.labels("ready").set(self.ready_s)
        log.info("ready %.2fs after the process started: %s", self.ready_s, self.describe())

    def on_step(self, step_started: float) -> None:
        """Each step's start (Unix seconds), reported as it ends: the first one is timed."""
        if P.FIRST_STEP in self.clock.seconds:
            return
        seconds = max(0.0, time.time() - step_started)
        self.clock.add(P.FIRST_STEP, seconds)
        self._gauge.labels(P.FIRST_STEP.name.lower()).set(seconds)
        log.info("first engine step: %.2fs", seconds)

    def describe(self) -> str:
        return ", ".join(
            f"{p.name.lower()} {s:.2f}s" for p, s in sorted(self.clock.seconds.items())
        )

    def wire(self) -> list[PhaseTime]:
        return [PhaseTime(phase, seconds) for phase, seconds in sorted(self.clock.seconds.items())]
