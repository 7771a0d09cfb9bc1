"""A process's command line as /proc shows it (/proc/PID/cmdline: what `ps`, `pgrep -f` and
our tests read), rewritten in place, for a standby worker that becomes another command.

Linux shows a process's command line from the memory its arguments were first written to
(between `arg_start` and `arg_end`, /proc/self/stat's fields 48 and 49), so a process can
write another one there, no larger than the first. A standby is started with `ROOM_ARG`
(ROOM_BYTES spaces) as its last argument, which leaves room for the worker's; `rewrite`
writes the new arguments NUL-separated, as the kernel wrote the first ones, and pads with
NULs, so a reader that splits on NUL finds the worker's arguments (then empty strings).

The one subtle rule: the last byte written stays NUL. Were it not, Linux would read the
area as one string in the `setproctitle(3)` manner (spaces for separators), and readers
that split on NUL would find one argument. The environment (/proc/PID/environ) is not
rewritten: it stays the one the process started with.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

ROOM_BYTES = 16384  # a standby's room for the worker's command line
ROOM_ARG = " " * ROOM_BYTES
ARG_START_AT = 45  # /proc/PID/stat's field 48 (arg_start; 49: arg_end) among those after `comm`


def encoded(argv: Sequence[str]) -> bytes:
    """`argv` as the kernel lays it out: each argument NUL-terminated."""
    return b"".join(os.fsencode(arg) + b"\0" for arg in argv)


def fits(argv: Sequence[str]) -> bool:
    """Whether a standby's room (its own command line included) holds `argv`."""
    return len(encoded(argv)) <= ROOM_BYTES


def own_span() -> tuple[int, int] | None:
    """(arg_start, arg_end) of this process's command line, or None where /proc does not
    say or says something other than what /proc/self/cmdline reads."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[ARG_START_AT]), int(fields[ARG_START_AT + 1])
        shown = Path("/proc/self/cmdline").read_bytes()
    except (OSError, IndexError, ValueError):
        return None
    if not 0 < start < end or ctypes.string_at(start, end - start) != shown:
        return None
    return start, end


def rewrite(argv: Sequence[str]) -> bool:
    """Make /proc/self/cmdline read `argv`; False (nothing written) where it does not fit
    or the area is not where /proc says."""
    span = own_span()
    data = encoded(argv)
    if span is None or len(data) > span[1] - span[0]:
        return False
    start, end = span
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)
    return shows(os.getpid(), argv)


def shows(pid: int, argv: Sequence[str]) -> bool:
    """Whether /proc/PID/cmdline reads `argv` (NUL padding after it allowed)."""
    try:
        shown = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    data = encoded(argv)
    return shown[: len(data)] == data and not shown[len(data) :].strip(b"\0")
