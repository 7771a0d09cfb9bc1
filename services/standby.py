"""A standby worker: a process `up` starts before it needs it, which imports what every
worker imports (torch, the engine, NATS: most of a worker's start once its weights are
mapped, docs/start.md) and then waits on its stdin for the command line of the worker it is
to become. `up` hands it the next worker it starts while serving (a PoolTarget's ADD, a
restart, a reload's new worker) and starts another standby for the one after.

Both sides are here: `StandbyWorker` (up's: spawn, hand off, close) and `main` (the
standby's: import, wait, run the handed-off `python -m MODULE ARGS...` in this process).

Handed off, it first makes its command line the worker's (services/proc_argv.py: ps,
`pgrep -f` and /proc/PID/cmdline show the worker, not `services.standby`); `take` hands the
process back only once /proc shows that, and a standby that cannot rewrite it exits
REFUSED without running the worker (a fresh process starts it instead). Once its imports are
done it says so, to `up` (a byte on a pipe: only a ready standby is handed a worker, one
still importing keeps waiting) and on stderr (READY_LINE, in `up`'s log).

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
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from services.proc_argv import ROOM_ARG, fits, own_span, rewrite, shows

log = logging.getLogger(__name__)

HANDED_OFF_AT_ENV = "SPLITSERVE_HANDED_OFF_AT"  # time.time() of the hand-off, in the worker
WARM_IMPORTS = ("services.worker.runtime",)  # what every worker imports before it starts
READY_LINE = "standby worker ready"  # on stderr once the imports are done
READY_FD_ENV = "SPLITSERVE_STANDBY_READY_FD"  # the pipe a standby says it is ready on
REFUSED = 75  # the standby's exit status when it cannot become the handed-off command
HANDOFF_S = 5.0  # for /proc to show the handed-off command line
POLL_S = 0.002


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
        self._ready_fd: int | None = None  # the standby writes a byte there once imported
        self._ready = False

    def spawn(self) -> None:
        """Start a standby unless one is waiting, or one died waiting (no start loop)."""
        if self.process is not None:
            code = self.process.poll()
            if code is None:
                return
            log.warning("the standby worker exited with %s while it waited: no more", code)
            self._let_go()
            self.died = True
        if self.died:
            return
        read_fd, write_fd = os.pipe()
        command = (sys.executable, "-m", "services.standby", ROOM_ARG)
        try:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                start_new_session=True,
                env=self.environment | {READY_FD_ENV: str(write_fd)},
                pass_fds=(write_fd,),
            )
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._ready_fd, self._ready = read_fd, False

    def ready(self) -> bool:
        """Whether a standby waits with its imports done (never blocks)."""
        fd = self._ready_fd
        if not self._ready and fd is not None and select.select([fd], [], [], 0)[0]:
            self._ready = os.read(fd, 1) == b"1"  # its byte; b"": it ended
        return self._ready and self.process is not None and self.process.poll() is None

    def take(self, argv: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """The waiting standby, running `argv` (a `python -m MODULE ...` command) from now
        on, once /proc shows `argv` as its command line; None when none waits ready (one
        still importing keeps waiting), it refused, or `argv` is not such a command or does
        not fit its room."""
        usable = argv[:2] == (sys.executable, "-m") and len(argv) > 2 and fits(argv)
        if not usable or not self.ready():
            return None
        process = self._let_go()
        assert process is not None and process.stdin is not None  # ready(): one waits
        line = json.dumps(asdict(Handoff(list(argv[1:]), env))) + "\n"
        try:
            process.stdin.write(line.encode())
            process.stdin.close()
        except OSError:  # it died between the poll and the write
            self._end(process)
            return None
        deadline = time.monotonic() + HANDOFF_S
        while not shows(process.pid, argv):
            if process.poll() is not None:  # refused; or already ran the command, and ended
                return None if process.returncode == REFUSED else process
            if time.monotonic() >= deadline:
                log.warning("the standby worker did not take its command line: not used")
                self._end(process)
                return None
            time.sleep(POLL_S)
        return process

    def close(self) -> None:
        """Stop a waiting standby."""
        self._end(self._let_go())

    def _let_go(self) -> subprocess.Popen[bytes] | None:
        """The standby process, no longer this one's to hand off."""
        process, self.process = self.process, None
        if self._ready_fd is not None:
            os.close(self._ready_fd)
        self._ready_fd, self._ready = None, False
        return process

    @staticmethod
    def _end(process: subprocess.Popen[bytes] | None) -> None:
        if process is None or process.poll() is not None:
            return
        process.kill()
        process.wait()


def main() -> int:
    if own_span() is None:
        print("standby: /proc does not show where its command line is", file=sys.stderr)
        return REFUSED
    warmed = time.perf_counter()
    for module in WARM_IMPORTS:
        __import__(module)
    ready_fd = int(os.environ.pop(READY_FD_ENV, "-1"))
    if ready_fd >= 0:
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    print(
        f"{READY_LINE} (pid {os.getpid()}): imports done in {time.perf_counter() - warmed:.2f}s",
        file=sys.stderr,
        flush=True,
    )
    line = sys.stdin.buffer.readline()
    handed_off_at = time.time()
    if not line:
        return 0  # up closed it: not needed
    handoff = Handoff(**json.loads(line))
    flag, module, *args = handoff.argv
    if flag != "-m":
        print(f"standby: a hand-off runs `-m MODULE ...`, not {handoff.argv[:2]}", file=sys.stderr)
        return REFUSED
    if not rewrite([sys.executable, *handoff.argv]):
        print("standby: could not show the handed-off command line", file=sys.stderr)
        return REFUSED
    os.environ.clear()
    os.environ.update(handoff.env)
    os.environ[HANDED_OFF_AT_ENV] = repr(handed_off_at)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
