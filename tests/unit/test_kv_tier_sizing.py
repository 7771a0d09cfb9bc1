"""The second KV tier's size (shared/engine/kv_tier/sizing.py): what `--kv-offloading-size`
says when given (0: no tier); unset, the services' default, an automatic size that never
takes more than a quarter of the directory's free space and is off where that is tiny (a
container's 64 MiB /dev/shm). An engine made in code has no tier unless asked."""

from __future__ import annotations

import argparse
import shutil
from collections import namedtuple

import pytest

from services.worker import cli as worker_cli
from shared.engine.engine_config import EngineConfig
from shared.engine.kv_tier import sizing
from shared.engine.kv_tier.sizing import AUTO_GIB, tier_capacity
from tests.unit.test_kv_tier import make_engine

Usage = namedtuple("Usage", "total used free")
GIB = 2**30


def free_space(monkeypatch: pytest.MonkeyPatch, free: int) -> list[str]:
    """Make the filesystem under any path report `free` bytes; the paths asked, in order."""
    asked: list[str] = []

    def disk_usage(path: object) -> Usage:
        asked.append(str(path))
        return Usage(free * 2, free, free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return asked


def test_a_given_size_is_taken_as_it_is(monkeypatch, tmp_path):
    asked = free_space(monkeypatch, 0)
    assert tier_capacity(1.5, tmp_path) == int(1.5 * GIB)
    assert tier_capacity(0.0, tmp_path) == 0
    assert asked == []  # a size given needs no look at the disk


def test_the_automatic_size_is_two_gib_or_a_quarter_of_the_free_space(monkeypatch, tmp_path):
    free_space(monkeypatch, 100 * GIB)
    assert tier_capacity(None, tmp_path) == int(AUTO_GIB * GIB)
    free_space(monkeypatch, 4 * GIB)
    assert tier_capacity(None, tmp_path) == GIB


def test_the_automatic_tier_is_off_where_the_directory_has_little_room(
    monkeypatch, tmp_path, caplog
):
    free_space(monkeypatch, 64 * 2**20)  # a container's /dev/shm
    with caplog.at_level("INFO", logger=sizing.__name__):
        assert tier_capacity(None, tmp_path) == 0
    assert "KV tier: off" in caplog.text and "--kv-offloading-size" in caplog.text


def test_the_free_space_is_that_of_the_nearest_directory_that_exists(monkeypatch, tmp_path):
    asked = free_space(monkeypatch, 100 * GIB)
    tier_capacity(None, tmp_path / "not" / "yet")
    assert asked == [str(tmp_path)]


def test_the_services_default_is_automatic_and_an_engine_in_code_has_none(
    monkeypatch, tmp_path, tiny_model_dir
):
    monkeypatch.delenv("SPLITSERVE_KV_OFFLOADING_SIZE", raising=False)
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    args = parser.parse_args(["--role", "both", "--model-dir", str(tiny_model_dir)])
    assert args.kv_offloading_size is None
    assert EngineConfig(model_dir=tiny_model_dir).kv_offloading_size == 0.0

    free_space(monkeypatch, 100 * GIB)
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=None)
    try:
        assert engine.block_manager.tier is not None
        assert engine.block_manager.tier.store.capacity_bytes == int(AUTO_GIB * GIB)
    finally:
        engine.close()
    free_space(monkeypatch, 2**20)
    engine = make_engine(tiny_model_dir, tmp_path, kv_offloading_size=None)
    try:
        assert engine.block_manager.tier is None
    finally:
        engine.close()
