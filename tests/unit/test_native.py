"""The native build's staleness check: a library whose recorded digest no longer matches
csrc is rebuilt on load, and a failing rebuild leaves torch (None) with a warning rather
than the stale kernels, and a build killed midway never blocks the next. No compiler runs
here: the sources and the library are stand-ins."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from shared.engine import native


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A build directory with a 'library' and a source file, both stand-ins."""
    source = tmp_path / "src" / "kernel.cpp"
    source.parent.mkdir()
    source.write_text("// v1\n")
    monkeypatch.setattr(native, "SOURCES", [source])
    monkeypatch.setattr(native, "HEADERS", [])
    monkeypatch.setattr(native, "BUILD_DIR", tmp_path / "build")
    native.BUILD_DIR.mkdir()
    native.library_path().write_bytes(b"not really a library")
    native.digest_path().write_text(native.source_digest() + "\n")
    native.load.cache_clear()
    yield source
    native.load.cache_clear()  # the next caller loads the real kernels again


def test_a_build_is_current_until_its_sources_change(fake_build):
    assert native.is_current()
    fake_build.write_text("// v2\n")
    assert not native.is_current()


def test_a_library_without_a_digest_is_stale(fake_build):
    native.digest_path().unlink()
    assert not native.is_current()


def test_without_sources_the_shipped_library_is_current(fake_build, monkeypatch):
    monkeypatch.setattr(native, "SOURCES", [])  # an installed package, as in the images
    native.digest_path().unlink()
    assert native.is_current()


def test_a_failing_rebuild_warns_and_loads_nothing(fake_build, monkeypatch, caplog):
    def failing_build(verbose: bool = False):
        raise RuntimeError("compiler says no")

    monkeypatch.setattr(native, "build", failing_build)
    fake_build.write_text("// v2\n")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load() is None
    assert "rebuilding" in caplog.text and "compiler says no" in caplog.text


def test_a_killed_builds_torch_lock_does_not_block_the_next_build(fake_build, monkeypatch):
    """cpp_extension waits, without end, for its lock file to go; one left by a killed build
    (seen: a benchmark stopped while its workers rebuilt) is removed under build.lock."""
    from torch.utils import cpp_extension

    stale = native.BUILD_DIR / native.TORCH_BUILD_LOCK
    stale.write_text("")
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: seen.append(stale.exists()))
    fake_build.write_text("// v2\n")
    native.build()
    assert seen == [False]
    assert native.is_current()


def test_the_build_directory_follows_splitserve_native_dir(tmp_path):
    """A checkout that changes csrc builds into a directory of its own, not the venv's."""
    env = {**os.environ, "SPLITSERVE_NATIVE_DIR": str(tmp_path / "mine")}
    code = "from shared.engine import native; print(native.library_path())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path / "mine" / native.NAME))
