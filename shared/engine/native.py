"""The C++ CPU kernels (csrc/cpu): built ahead of time by `make install`, loaded at run time.

`python -m shared.engine.native` compiles them with torch's cpp_extension (ninja) into the
environment (`<sys.prefix>/lib/splitserve-native/`), so editable and image installs alike
find them and `make clean` removes them. Without a compiler the build prints why and exits
0: the engine then uses the torch attention backend. `load()` imports the built module,
or returns None.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))
BUILD_DIR = Path(sys.prefix) / "lib" / "splitserve-native"
NAME = "splitserve_cpu"
# -march=native: the kernels are built on the host that runs them (make install, image build).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]


def build(verbose: bool = False) -> Path:
    """Compile the extension; returns the path of the shared library."""
    from torch.utils import cpp_extension

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=NAME,
        sources=[str(s) for s in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(BUILD_DIR),
        verbose=verbose,
    )
    return library_path()


def library_path() -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[-1]  # ".so" on Linux
    return BUILD_DIR / f"{NAME}{suffix}"


@cache
def load() -> ModuleType | None:
    """The built kernels, or None when they were not built."""
    path = library_path()
    if not path.exists():
        return None
    import torch  # noqa: F401  (the extension links against libtorch)

    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    try:
        path = build(verbose=bool(os.environ.get("SPLITSERVE_BUILD_VERBOSE")))
    except Exception as exc:  # no compiler, no ninja, a failing compile: all leave torch
        print(
            f"splitserve: C++ CPU kernels not built ({type(exc).__name__}: {exc}).\n"
            "splitserve: install a C++ compiler (g++) and rerun `make install` for them; "
            "the engine uses the torch attention backend meanwhile.",
            file=sys.stderr,
        )
        return 0
    print(f"splitserve: C++ CPU kernels built: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
