"""`TierStore`: a bounded directory of tier entries, one file per block hash, LRU by use.

Each engine owns a directory of its own under the tier's root, named by its layout's digest
and held with an exclusive `flock` for the engine's life, so workers on one machine may share
a root. At start a store empties every sibling directory that no live process holds: what a
stopped worker (or one of another model or dtype) wrote never outlives it, and a different
model never reads it (its entries are refused by their header besides, entry.py).

The one subtle rule: the index (hash → bytes, oldest first) is the truth about what is
stored, and it is guarded by one lock, since the writer thread `put`s while the engine's
thread `get`s. File I/O happens outside the lock; a file written is renamed into place
whole, so a reader never sees half of one, and a missing file is a miss. An entry is
written from its pieces (no joined copy) and read into a buffer of the size it was stored
with (a file grown or shrunk since reads as what it is: the entry's checks refuse it).
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from shared.engine.kv_tier.entry import Buffer, TierLayout
from shared.engine.stats import KVCacheEvents, KVEventLog

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


def write_file(path: Path, parts: Sequence[Buffer]) -> None:
    """Write `parts`, one after another, to `path` whole, in one system call: a temporary
    file, then a rename (no fsync: the tier dies with the engine, a crash loses nothing
    it needs). A short write (a full disk) is an OSError."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = os.writev(fd, parts)
    finally:
        os.close(fd)
    size = sum(len(part) for part in parts)
    if written != size:
        tmp.unlink(missing_ok=True)
        raise OSError(errno.ENOSPC, f"wrote {written} of {size} bytes", str(tmp))
    os.replace(tmp, path)


class TierStore:
    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        layout: TierLayout,
        write: Callable[[Path, Sequence[Buffer]], None] = write_file,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self._write = write
        root.mkdir(parents=True, exist_ok=True)
        _empty_unheld(root)
        self.path = Path(tempfile.mkdtemp(prefix=f"{layout.digest}.", dir=root))
        self._lock_file = open(self.path / LOCK_NAME, "wb")  # noqa: SIM115 (held for life)
        fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> bytes, oldest first
        self._lock = threading.Lock()
        self.stored_bytes = 0
        self.evictions = 0  # since start: entries dropped to stay under the capacity
        self._events = KVEventLog()  # hashes stored and removed since the last take

    def holds(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def put(self, block_hash: int, parts: Sequence[Buffer]) -> bool:
        """Store an entry, given as its pieces (OSError when the file cannot be written).
        False when it is already stored or larger than the whole capacity."""
        size = sum(len(part) for part in parts)
        if size > self.capacity_bytes or self.holds(block_hash):
            return False
        self._write(self._file(block_hash), parts)
        with self._lock:
            self._index[block_hash] = size
            self.stored_bytes += size
            self._events.stored(block_hash)
            victims = []
            while self.stored_bytes > self.capacity_bytes:
                victim, size = self._index.popitem(last=False)
                self.stored_bytes -= size
                self.evictions += 1
                self._events.removed(victim)
                victims.append(victim)
        for victim in victims:
            self._file(victim).unlink(missing_ok=True)
        return True

    def get(self, block_hash: int) -> memoryview | None:
        """The entry's bytes (writable: a tensor may be made on them without a copy), or None
        when it is not stored (OSError when unreadable)."""
        with self._lock:
            size = self._index.get(block_hash)
            if size is None:
                return None
            self._index.move_to_end(block_hash)
        data = bytearray(size + 1)  # one byte more: a file that grew reads as too long
        try:
            with open(self._file(block_hash), "rb", buffering=0) as entry:
                count = _read_into(entry, memoryview(data))
        except FileNotFoundError:
            self.discard(block_hash)
            return None
        return memoryview(data)[:count]

    def discard(self, block_hash: int) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stored_bytes -= size
                self._events.removed(block_hash)
        self._file(block_hash).unlink(missing_ok=True)

    def take_events(self) -> KVCacheEvents:
        """The hashes stored and removed since the last call (as `stored`, `removed`)."""
        with self._lock:
            return self._events.take()

    def close(self) -> None:
        """Remove this store's directory (its entries die with the engine)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock_file.close()

    def _file(self, block_hash: int) -> Path:
        return self.path / f"{block_hash:016x}.kv"


def _read_into(entry: io.RawIOBase, buffer: memoryview) -> int:
    """Fill `buffer` from the file `entry` until it is full or the file ends; bytes read."""
    count = 0
    while count < len(buffer):
        got = entry.readinto(buffer[count:])
        if not got:
            break
        count += got
    return count


def _empty_unheld(root: Path) -> None:
    """Remove every directory under `root` that no live process holds locked."""
    for child in root.iterdir():
        if not child.is_dir():
            continue
        try:
            with open(child / LOCK_NAME, "rb") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live engine's
        except OSError:
            pass  # no lock file: a broken directory, removed too
        log.info("KV tier: removing %s, left by an engine that stopped", child)
        shutil.rmtree(child, ignore_errors=True)
