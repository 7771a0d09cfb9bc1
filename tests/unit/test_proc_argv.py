"""A process's command line rewritten in place (services/proc_argv.py): /proc/PID/cmdline,
read as ps and our tests read it (split on NUL), shows the new arguments one by one, spaces
inside an argument kept; one that does not fit the room is refused and nothing changes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from services.proc_argv import ROOM_ARG, ROOM_BYTES, fits, shows

REWRITE = """
import json, os, sys
from pathlib import Path
from services.proc_argv import rewrite
wanted = json.loads(sys.stdin.read())
done = rewrite(wanted)
shown = [a.decode() for a in Path("/proc/self/cmdline").read_bytes().split(b"\\0") if a]
print(json.dumps({"done": done, "shown": shown}))
"""


def run(wanted: list[str], *room: str) -> dict:
    argv = [sys.executable, "-c", REWRITE, *room]  # `wanted` on stdin: not in its own room
    out = subprocess.run(
        argv, input=json.dumps(wanted), capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


def test_a_process_with_room_shows_the_new_command_line_argument_by_argument():
    wanted = ["/usr/bin/python3", "-m", "services.cli", "worker", "--worker-id", "w 1"]
    assert run(wanted, ROOM_ARG) == {"done": True, "shown": wanted}


def test_a_command_line_that_does_not_fit_is_refused_and_nothing_changes():
    wanted = ["python", "-m", "services.cli", "worker", "x" * 4096]
    found = run(wanted)  # no room: only its own command line's bytes
    assert found["done"] is False
    assert found["shown"][:2] == [sys.executable, "-c"]
    assert fits(wanted) and not fits(["x" * ROOM_BYTES])


def test_shows_reads_another_process_s_command_line():
    argv = [sys.executable, "-c", "import time; time.sleep(30)", "a b"]
    process = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 30
        while not shows(process.pid, argv):  # until it has exec'd
            assert time.monotonic() < deadline, "the command line never showed"
            time.sleep(0.01)
        assert not shows(process.pid, [sys.executable, "-c", "import time; time.sleep(30)"])
        assert not shows(process.pid, [sys.executable, "-c"])  # a prefix is not the whole
    finally:
        process.kill()
        process.wait()
