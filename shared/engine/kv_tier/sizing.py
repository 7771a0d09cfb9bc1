"""How many bytes the second KV tier may hold: `--kv-offloading-size` when given (0: no tier),
else the automatic size — at most `AUTO_GIB`, and at most `AUTO_SHARE` of the free space
under the tier's directory when the engine starts.

The one subtle rule: the automatic size never fills the directory's filesystem. /dev/shm is
memory that nothing can page out, and a container's is often 64 MiB; where a quarter of the
free space is under `AUTO_MIN_BYTES` the tier is off, and the log says why, once.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

AUTO_GIB = 2.0  # the automatic size at most (docs/kv_tier.md, "Default": why on, and why 2)
AUTO_SHARE = 0.25  # of the free space under the directory at start
AUTO_MIN_BYTES = 64 * 2**20  # an automatic tier smaller than this is not opened


def tier_capacity(size_gib: float | None, root: Path) -> int:
    """Bytes for a tier under `root`: `size_gib` GiB when set, else the automatic size
    (0 when that is under AUTO_MIN_BYTES)."""
    if size_gib is not None:
        return int(size_gib * 2**30)
    free = shutil.disk_usage(_existing(root)).free
    capacity = min(int(AUTO_GIB * 2**30), int(free * AUTO_SHARE))
    if capacity < AUTO_MIN_BYTES:
        log.info(
            "KV tier: off (automatic size: %.0f MiB free under %s; --kv-offloading-size sets one)",
            free / 2**20,
            root,
        )
        return 0
    return capacity


def _existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (the tier makes its directory later)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
