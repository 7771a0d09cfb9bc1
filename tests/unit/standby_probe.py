"""Run by a test as the command a standby worker is handed (`-m tests.unit.standby_probe
OUT ARGS...`): writes what it finds to OUT as JSON, its command line as /proc shows it too."""

import json
import os
import sys
from pathlib import Path

from services.standby import HANDED_OFF_AT_ENV, WARM_IMPORTS

out, *args = sys.argv[1:]
found = {
    "args": args,
    "probe_env": os.environ.get("STANDBY_PROBE", ""),
    "handed_off": HANDED_OFF_AT_ENV in os.environ,
    "warm": all(module in sys.modules for module in WARM_IMPORTS),
    "name": __name__,
    "cmdline": [a.decode() for a in Path("/proc/self/cmdline").read_bytes().split(b"\0") if a],
}
with open(out, "w") as file:
    json.dump(found, file)
sys.exit(int(os.environ.get("STANDBY_PROBE_EXIT", "0")))
