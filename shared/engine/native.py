"""The C++ CPU kernels (csrc/cpu): built ahead of time by `make install`, loaded at run time.

`python -m shared.engine.native` compiles them with torch's cpp_extension (ninja) into the
environment (`<sys.prefix>/lib/splitserve-native/`), so editable and image installs alike
find them and `make clean` removes them. `SPLITSERVE_NATIVE_DIR` names another build
directory (read once, at import): a checkout that changes csrc builds and loads its own
library there instead of rebuilding the one every other checkout on the venv loads.
Without a compiler the build prints why and exits 0: the engine then uses the torch
attention backend and torch's matmuls.

A build records a digest of what went into it (the sources, the flags, torch's version)
next to the library. `load()` imports the built module, or returns None when none was built;
a build whose digest no longer matches (csrc changed since) is rebuilt first (ninja only
recompiles what changed), and when that fails `load()` warns and returns None rather than
run stale kernels.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))
HEADERS = sorted((ROOT / "csrc" / "cpu").glob("*.h"))
BUILD_DIR = Path(
    os.environ.get("SPLITSERVE_NATIVE_DIR") or Path(sys.prefix) / "lib" / "splitserve-native"
)
NAME = "splitserve_cpu"
# -march=native: the kernels are built on the host that runs them (make install, image build).
TORCH_BUILD_LOCK = "lock"  # cpp_extension's file baton in the build directory
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]

log = logging.getLogger(__name__)


def source_digest() -> str:
    """sha256 of the sources, headers, flags and torch version a build is made from."""
    import torch

    digest = hashlib.sha256(f"{torch.__version__} {' '.join(CFLAGS)}".encode())
    for path in SOURCES + HEADERS:
        digest.update(f"\0{path.name}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def digest_path() -> Path:
    return BUILD_DIR / f"{NAME}.sha256"


def is_current() -> bool:
    """Whether a library is built, from the sources as they are now. Where the sources do
    not ship (a non-editable install, as in the images), the library built with it is."""
    if not library_path().exists():
        return False
    if not SOURCES:
        return True
    stamp = digest_path()
    return stamp.exists() and stamp.read_text().strip() == source_digest()


def build(verbose: bool = False) -> Path:
    """Compile the extension unless it is current; returns the path of the shared library.
    Builds hold a lock file, so a process that waited on another's build checks again, and a
    digest always describes the library beside it."""
    from torch.utils import cpp_extension

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_current():
            return library_path()
        digest = source_digest()  # of the sources as they are when the compile starts
        digest_path().unlink(missing_ok=True)
        # torch's own lock file, left behind by a build that was killed, would make
        # cpp_extension wait for it forever; holding build.lock, no other build is running
        (BUILD_DIR / TORCH_BUILD_LOCK).unlink(missing_ok=True)
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(BUILD_DIR),
            verbose=verbose,
        )
        digest_path().write_text(digest + "\n")
    return library_path()


def library_path() -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[-1]  # ".so" on Linux
    return BUILD_DIR / f"{NAME}{suffix}"


@cache
def load() -> ModuleType | None:
    """The built kernels (rebuilt first if csrc changed since), or None when they were never
    built or the rebuild failed."""
    path = library_path()
    if not path.exists():
        return None
    import torch  # noqa: F401  (the extension links against libtorch)

    if not is_current():
        log.warning("splitserve: csrc/cpu changed since the C++ kernels were built; rebuilding")
        try:
            build()
        except Exception as exc:  # a failing compile: never load the stale library
            log.warning(
                "splitserve: rebuilding the C++ kernels failed (%s: %s); using torch instead. "
                "Fix the build and run `python -m shared.engine.native` (or `make install`).",
                type(exc).__name__,
                exc,
            )
            return None

    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    if is_current():
        print(f"splitserve: C++ CPU kernels up to date: {library_path()}")
        return 0
    try:
        path = build(verbose=bool(os.environ.get("SPLITSERVE_BUILD_VERBOSE")))
    except Exception as exc:  # no compiler, no ninja, a failing compile: all leave torch
        print(
            f"splitserve: C++ CPU kernels not built ({type(exc).__name__}: {exc}).\n"
            "splitserve: install a C++ compiler (g++) and rerun `make install` for them; "
            "the engine uses torch's attention and matmuls (not batch-invariant) meanwhile.",
            file=sys.stderr,
        )
        return 0
    print(f"splitserve: C++ CPU kernels built: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
