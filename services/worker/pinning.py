"""A worker pinned to its own cores (`--cpus 0-1`): the core list's syntax, the check against
the cores this machine lets the process use, and the pin itself.

A pinned worker runs one torch thread per core and no core lease (services/worker/
native_client.py starts a lease only when `num_threads` is None): it never borrows another
worker's core nor yields its own, which is what an equal-hardware comparison of pools needs.

The one subtle rule: Linux keeps an affinity per thread, and a thread inherits its creator's.
`pin` therefore runs before the engine (and torch's thread pool) starts, and pins every
thread the process already has, not only the calling one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from shared.errors import ConfigError

_TASKS = Path("/proc/self/task")


def parse_cpus(text: str) -> tuple[int, ...]:
    """`0`, `0-1`, `0,2`, `0-3,6` → the cores, sorted; `` → () (unpinned). ConfigError when
    the text is not a core list, or names a core twice."""
    cpus: list[int] = []
    for part in (p.strip() for p in text.split(",")) if text.strip() else ():
        first, dash, last = part.partition("-")
        if not (first.isdigit() and (not dash or last.isdigit())):
            raise ConfigError(f"cpus {text!r}: {part!r} is not a core or a range like 0-3")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ConfigError(f"cpus {text!r}: the range {part!r} runs backwards")
        cpus += range(low, high + 1)
    if len(set(cpus)) != len(cpus):
        raise ConfigError(f"cpus {text!r}: a core is named twice")
    return tuple(sorted(cpus))


def cpu_list(cpus: Iterable[int]) -> str:
    """`(0, 1, 2, 5)` → `0-2,5`: the form `--cpus`, `taskset -c` and vLLM take."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def usable_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity: a container's cpuset, a taskset)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def check_cpus(cpus: Iterable[int]) -> None:
    """ConfigError naming the cores of `cpus` this process may not run on."""
    usable = usable_cpus()
    missing = sorted(set(cpus) - set(usable))
    if missing:
        raise ConfigError(
            f"cpus {cpu_list(missing)}: not among this machine's usable cores {cpu_list(usable)}"
        )


def pin(cpus: tuple[int, ...]) -> None:
    """Run this process, every thread it has and every thread it starts, on `cpus` alone;
    () leaves it as it is. ConfigError for a core it may not use."""
    if not cpus:
        return
    check_cpus(cpus)
    threads = [int(t) for t in os.listdir(_TASKS)] if _TASKS.is_dir() else [0]
    for thread in threads:
        try:
            os.sched_setaffinity(thread, cpus)
        except ProcessLookupError:  # a thread that ended since the listing
            continue
