"""llama.cpp's `llama-server`, built from the source inside the `llama-cpp-python` sdist.

PyPI is the one registry our machines reach, and the sdist of `llama-cpp-python` vendors
llama.cpp's whole tree, server included. It is downloaded, unpacked and built (CMake,
native CPU flags, no web UI, no network features) under the peers' venv, with a deadline
over all steps; `llama-perplexity` is built beside the server (the same libraries and one
more file), to compare perplexity with `splitserve bench quant --llama-windows`. The outcome
is cached with a digest of what was built: a binary is reused; a build that ran out of time
resumes on the next run (the unpacked source and the objects compiled so far are kept); a
failed step is reported again without retrying until that directory is removed.

One patch is applied to the source: GCC 12's `_tile_loadconfig` tells the compiler it reads
8 bytes of the 64-byte tile configuration, so the stores that fill the rest are dropped and
ggml's AMX matmul faults on an AMX CPU (the same bug hit our own kernels, csrc/cpu/
amx_tiles.cpp); a compiler barrier before the call keeps them, and the peer runs its AMX
kernels as a newer compiler builds them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.peers.deadline_run import run_to_log

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
)  # fmt: skip
TARGETS = ("llama-server", "llama-perplexity")
TILE_CONFIG = "_tile_loadconfig(&tc);"  # ggml-cpu/amx/mmq.cpp's one call
TILE_CONFIG_KEPT = 'asm volatile("" : : "r"(&tc) : "memory"); ' + TILE_CONFIG


@dataclass(frozen=True, slots=True)
class LlamaServerBuild:
    binary: Path | None  # None: not built, `reason` says why
    reason: str = ""

    @property
    def perplexity(self) -> Path | None:
        """llama-perplexity, built beside the server."""
        return None if self.binary is None else self.binary.parent / "llama-perplexity"


def build_digest() -> str:
    recipe = [LLAMA_CPP_PYTHON, *CMAKE_FLAGS, *TARGETS, TILE_CONFIG_KEPT]
    return hashlib.sha256("\n".join(recipe).encode()).hexdigest()


def source_digest() -> str:
    return hashlib.sha256(LLAMA_CPP_PYTHON.encode()).hexdigest()


def ensure_llama_server(root: Path, timeout_s: float) -> LlamaServerBuild:
    """The cached build under `root`, or a new one within `timeout_s` seconds."""
    binary, stamp, failed = root / "build/bin/llama-server", root / ".stamp", root / ".failed"
    digest = build_digest()
    if binary.exists() and _reads(stamp) == digest:
        return LlamaServerBuild(binary)
    if _reads(failed).startswith(digest):
        reason = _reads(failed).partition("\n")[2]
        return LlamaServerBuild(None, f"{reason} (an earlier try; remove {root} to try again)")
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        return LlamaServerBuild(None, f"{' and '.join(missing)} not found")
    print(f"building llama-server from the {LLAMA_CPP_PYTHON} sdist (at most {timeout_s:.0f} s)")
    try:
        _build(root, digest, time.monotonic() + timeout_s)
    except BuildTimedOut as exc:
        return LlamaServerBuild(None, f"{exc}; the next run resumes it")
    except BuildFailed as exc:
        failed.write_text(f"{digest}\n{exc}")
        return LlamaServerBuild(None, str(exc))
    stamp.write_text(digest)
    return LlamaServerBuild(binary)


class BuildFailed(RuntimeError):
    pass


class BuildTimedOut(BuildFailed):
    pass


def _build(root: Path, digest: str, deadline: float) -> None:
    """Unpack the sdist once per digest, then configure and compile (incrementally)."""
    log = root / "build.log"
    if _reads(root / ".source") != source_digest():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        download = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            LLAMA_CPP_PYTHON, "-d", str(root / "sdist"),
        ]  # fmt: skip
        _run("download the sdist", download, log, deadline)
        (archive,) = (root / "sdist").glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(root / "src", filter="data")
        (root / ".source").write_text(source_digest())
    (source,) = (root / "src").glob("*/vendor/llama.cpp")
    keep_tile_config(source / "ggml/src/ggml-cpu/amx/mmq.cpp")
    configure = ["cmake", "-S", str(source), "-B", str(root / "build"), *CMAKE_FLAGS]
    _run("configure", configure, log, deadline)
    jobs = str(len(os.sched_getaffinity(0)))
    build = ["cmake", "--build", str(root / "build"), "--target", *TARGETS, "-j", jobs]
    _run("compile", build, log, deadline)


def keep_tile_config(mmq: Path) -> None:
    """The barrier before ggml's ldtilecfg (see the top), once; a tree without the call as
    written is left as it is."""
    if not mmq.exists():
        return
    text = mmq.read_text()
    if TILE_CONFIG in text and TILE_CONFIG_KEPT not in text:
        mmq.write_text(text.replace(TILE_CONFIG, TILE_CONFIG_KEPT))


def _run(what: str, command: list[str], log: Path, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise BuildTimedOut(f"out of time before the step '{what}'")
    try:
        code = run_to_log(command, log, left)
    except subprocess.TimeoutExpired as exc:
        raise BuildTimedOut(f"'{what}' ran past the deadline; see {log}") from exc
    if code != 0:
        raise BuildFailed(f"'{what}' failed (exit {code}); see {log}")


def _reads(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
