"""A test hook that holds one one-sided READ open at a chosen point, so a chaos test can kill
the worker being read at that point (issue 60, case 1: tests/chaos/test_hand_off.py).

Off unless the environment variable `SPLITSERVE_TEST_HOLD_READ` names a file (tests only;
it is no option of the mesh, and unset costs nothing). While that file exists, the next
READ of any worker of the mesh claims it (reads it and removes it, so exactly one READ is
held however many decode workers race) and is held as the file says, `<point>:<seconds>`:

| point | the READ while held |
|---|---|
| `before` | the offer checked, the peer connected; nothing posted yet |
| `in_flight` | posted, not progressed by the reader while held (the peer may answer) |
| `landed` | SUCCESS: every byte in; handle not released, the prefill side not answered |

A hold logs `test hold: READ of <n> blocks from <peer> held <point> for <s> s` as it starts
and `test hold: READ of <n> blocks from <peer> released <point>: <state>` as it ends (the
READ's state then, by one poll). The subtle rule: a hold is an `asyncio.sleep` on the
worker's loop, so the worker goes on beating and answering meanwhile, and an abort (a
`WorkerLost`, a `Cancel`) cancels the hold as it cancels any READ in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)
VARIABLE = "SPLITSERVE_TEST_HOLD_READ"


class Polled(Protocol):
    def poll(self) -> IntEnum:
        """The READ's state (transfer.py's `ReadHandle`); never blocks."""


class HoldPoint(IntEnum):
    BEFORE = 0
    IN_FLIGHT = 1
    LANDED = 2


@dataclass(frozen=True, slots=True)
class ReadHold:
    """One READ's hold: `seconds` at `point`."""

    point: HoldPoint
    seconds: float

    @classmethod
    def parse(cls, value: str) -> ReadHold:
        """`<point>:<seconds>`; ValueError naming what is wrong otherwise."""
        try:
            name, seconds = value.strip().split(":")
            hold = cls(HoldPoint[name.upper()], float(seconds))
        except (KeyError, ValueError):
            points = ", ".join(p.name.lower() for p in HoldPoint)
            raise ValueError(f"{value!r} is not <point>:<seconds> (points: {points})") from None
        if hold.seconds < 0:
            raise ValueError(f"{value!r}: seconds must not be negative")
        return hold

    async def at(self, point: HoldPoint, peer: str, blocks: int, handle: Polled | None) -> None:
        """Hold here if this is the point."""
        if point != self.point:
            return
        what, name = f"READ of {blocks} blocks from {peer}", point.name.lower()
        log.warning("test hold: %s held %s for %.1f s", what, name, self.seconds)
        await asyncio.sleep(self.seconds)
        state = handle.poll().name if handle is not None else "not posted"
        log.warning("test hold: %s released %s: %s", what, name, state)


@dataclass(frozen=True, slots=True)
class HoldFile:
    """The file that arms the next READ's hold."""

    path: Path

    def claim(self) -> ReadHold | None:
        """The hold the file asks for, removing it; None when there is none (or another
        READ claimed it first). A file that does not parse is removed and logged."""
        try:
            text = self.path.read_text()
            self.path.unlink()
        except FileNotFoundError:
            return None
        try:
            return ReadHold.parse(text)
        except ValueError as exc:
            log.error("test hold: %s in %s; no READ held", exc, self.path)
            return None


def hold_file() -> HoldFile | None:
    """The hook's file when the environment names one (tests), else None."""
    value = os.environ.get(VARIABLE, "")
    return HoldFile(Path(value)) if value else None
