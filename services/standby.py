"""A standby worker: a process `up` starts before it needs it, which imports what every
worker imports (torch, the engine, NATS: most of a worker's start once its weights are
mapped, docs/start.md) and then waits on its stdin for the command line of the worker it is
to become. `up` hands it the next worker it starts while serving (a PoolTarget's ADD, a
restart, a reload's new worker) and starts another standby for the one after.

Both sides are here: `StandbyWorker` (up's: spawn, hand off, close) and `main` (the
standby's: import, wait, run the handed-off `python -m MODULE ARGS...` in this process).

The one subtle rule: before its hand-off the standby only imports (no thread, no
connection, no torch op), so the worker it becomes starts as a fresh process would, with the
environment and arguments of the hand-off; its start-up clock (services/worker/startup.py)
counts from the hand-off (HANDED_OFF_AT_ENV), not from the standby's own start.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

HANDED_OFF_AT_ENV = "SPLITSERVE_HANDED_OFF_AT"  # time.time() of the hand-off, in the worker
WARM_IMPORTS = ("services.worker.runtime",)  # what every worker imports before it starts


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a standby becomes: `python ARGV...` (ARGV: `-m MODULE ARGS...`) in `env`."""

    argv: list[str]
    env: dict[str, str]


class StandbyWorker:
    """up's side: at most one standby process at a time."""

    def __init__(self, environment: dict[str, str]) -> None:
        self.environment = environment  # the standby's own, before any hand-off
        self.process: subprocess.Popen[bytes] | None = None
        self.died = False  # one exited while it waited: no more are started

    def spawn(self) -> None:
        """Start a standby unless one is waiting, or one died waiting (no start loop)."""
        if self.process is not None:
            code = self.process.poll()
            if code is None:
                return
            log.warning("the standby worker exited with %s while it waited: no more", code)
            self.process, self.died = None, True
        if self.died:
            return
        command = (sys.executable, "-m", "services.standby")
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, start_new_session=True, env=self.environment
        )

    def take(self, argv: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """The waiting standby, running `argv` (a `python -m MODULE ...` command) from now
        on; None when there is none, it died, or `argv` is not such a command."""
        process, self.process = self.process, None
        usable = argv[:2] == (sys.executable, "-m") and len(argv) > 2
        if process is None or process.poll() is not None or process.stdin is None or not usable:
            self._end(process)
            return None
        line = json.dumps(asdict(Handoff(list(argv[1:]), env))) + "\n"
        try:
            process.stdin.write(line.encode())
            process.stdin.close()
        except OSError:  # it died between the poll and the write
            self._end(process)
            return None
        return process

    def close(self) -> None:
        """Stop a waiting standby (its stdin closed: it exits)."""
        process, self.process = self.process, None
        self._end(process)

    @staticmethod
    def _end(process: subprocess.Popen[bytes] | None) -> None:
        if process is None or process.poll() is not None:
            return
        process.kill()
        process.wait()


def main() -> int:
    for module in WARM_IMPORTS:
        __import__(module)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # up closed it: not needed
    handoff = Handoff(**json.loads(line))
    os.environ.clear()
    os.environ.update(handoff.env)
    os.environ[HANDED_OFF_AT_ENV] = repr(time.time())
    flag, module, *args = handoff.argv
    if flag != "-m":
        sys.exit(f"standby: a hand-off runs `-m MODULE ...`, not {handoff.argv[:2]}")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
