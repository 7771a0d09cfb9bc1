"""How a service says it cannot run its configuration, so that `up` stops instead of
restarting it: exit status `CANNOT_RUN` (sysexits' EX_CONFIG) after its message.

The subtle rule: a supervised child also writes the message to the file its supervisor
named in `MESSAGE_FILE_ENV`, so `up` stops with the child's own words; a restart could only
fail the same way, so the supervisor never restarts a child that exits with this status.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

CANNOT_RUN = 78  # EX_CONFIG
MESSAGE_FILE_ENV = "SPLITSERVE_CANNOT_RUN_FILE"


def exit_cannot_run(service: str, message: str) -> NoReturn:
    """Print why `service` cannot run (and leave it for the supervisor); exit CANNOT_RUN."""
    print(f"splitserve {service}: cannot run: {message}", file=sys.stderr, flush=True)
    if path := os.environ.get(MESSAGE_FILE_ENV):
        Path(path).write_text(message)
    sys.exit(CANNOT_RUN)


def left_message(path: Path) -> str:
    """The message a child left at `path`, or a pointer to its log when it left none."""
    try:
        return path.read_text().strip() or "(see its log above)"
    except OSError:
        return "(see its log above)"
