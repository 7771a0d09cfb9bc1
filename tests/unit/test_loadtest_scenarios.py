"""Closed-loop scenarios: bundled ones, user files, weights, and the CLI's names."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loadtest.cli import SCENARIO_NAMES, parse_duration
from loadtest.scenarios import RAG_DOCUMENT, SCENARIOS, load_scenario
from loadtest.users import UserClass, assign_classes, between


def test_cli_lists_every_bundled_scenario() -> None:
    assert tuple(SCENARIOS) == SCENARIO_NAMES


def test_rag_requests_share_the_document() -> None:
    (rag,) = load_scenario("rag")
    rng = random.Random(0)
    prompts = [rag.pick(rng).make(rng).prompt for _ in range(5)]
    assert all(isinstance(p, str) and p.startswith(RAG_DOCUMENT) for p in prompts)
    assert len(RAG_DOCUMENT) > 5000  # about 1.5k tokens


def test_scenario_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.py"
    path.write_text(
        "from loadtest.scenarios import CHAT\n"
        "from loadtest.users import UserClass, between\n"
        "SCENARIO = (UserClass('solo', CHAT.tasks, between(0, 1)),)\n"
    )
    (user,) = load_scenario(str(path))
    assert user.name == "solo"
    with pytest.raises(ValueError, match="no scenario"):
        load_scenario("nonexistent")


def test_users_spread_by_weight() -> None:
    a = UserClass("a", (), between(0, 0), weight=6)
    b = UserClass("b", (), between(0, 0), weight=3)
    c = UserClass("c", (), between(0, 0), weight=1)
    names = [u.name for u in assign_classes((a, b, c), 10)]
    assert (names.count("a"), names.count("b"), names.count("c")) == (6, 3, 1)
    assert names[:2] == ["a", "b"]  # interleaved, not in blocks


def test_between_and_durations() -> None:
    rng = random.Random(0)
    waits = [between(1, 3)(rng) for _ in range(1000)]
    assert min(waits) >= 1 and max(waits) <= 3
    assert parse_duration("90s") == 90 and parse_duration("2m") == 120
    assert parse_duration("1.5") == 1.5
