"""`--lora-modules` as vLLM takes it (space-separated), comma-separated and repeated too, and
`SPLITSERVE_LORA_MODULES` comma-separated; `splitserve up` forwards it to its workers."""

from __future__ import annotations

import argparse

from services.cli import build_parser
from services.worker import cli as worker_cli


def worker_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser.parse_args(["--model-dir", "/m", *argv])


def test_lora_modules_take_spaces_commas_and_repeats():
    spaced = worker_args(["--lora-modules", "a=/x", "b=/y", "--max-loras", "2"])
    assert spaced.lora_modules == ("a=/x", "b=/y") and spaced.max_loras == 2
    mixed = worker_args(["--lora-modules", "a=/x,b=/y", "--lora-modules", "c=/z"])
    assert mixed.lora_modules == ("a=/x", "b=/y", "c=/z")


def test_the_variable_is_comma_separated(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_LORA_MODULES", "a=/x, b=/y")
    assert worker_args([]).lora_modules == ("a=/x", "b=/y")


def test_up_forwards_the_adapters_to_its_workers():
    up = build_parser().parse_args(["up", "--lora-modules", "a=/x", "b=/y", "--max-loras", "3"])
    config = worker_cli.config_from_args(worker_args(list(worker_cli.engine_argv(up))))
    assert config.engine.lora_modules == ("a=/x", "b=/y")
    assert config.engine.max_loras == 3 and config.engine.lora_enabled
