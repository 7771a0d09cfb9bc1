"""A one-line progress bar on stderr (redrawn in place on a terminal, sparse otherwise)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass(slots=True)
class Progress:
    total: int  # 0 = unknown (closed loop: counts up)
    label: str = ""
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    done: int = 0
    errors: int = 0
    start: float = field(default_factory=time.perf_counter)
    _last_draw: float = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        now = time.perf_counter()
        if now - self._last_draw >= (0.1 if self.stream.isatty() else 5.0):
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self, now: float) -> None:
        elapsed = now - self.start
        if self.total:
            filled = int(30 * self.done / self.total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done} done"
        end = "\r" if self.stream.isatty() else "\n"
        self.stream.write(f"{self.label} {bar} errors {self.errors} {elapsed:6.1f}s{end}")
        self.stream.flush()
