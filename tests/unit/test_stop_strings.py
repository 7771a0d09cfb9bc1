"""Stop strings: excluded from the output, matched across pieces, earliest match wins."""

from __future__ import annotations

import pytest

from services.gateway.stop_strings import StopStringMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    ("stops", "pieces", "expected"),
    [
        (["STOP"], ["hello STOP world"], ("hello ", True)),
        (["STOP"], ["hello S", "T", "OP world"], ("hello ", True)),
        (["STOP"], ["hello ST", "ART"], ("hello START", False)),
        (["\n\n", "END"], ["a\n", "b EN", "D c\n\n"], ("a\nb ", True)),
        (["bc", "ab"], ["xa", "bc"], ("x", True)),  # overlapping: the earlier one wins
        (["aab"], ["a", "a", "a", "b"], ("a", True)),  # a partial match restarts inside
        ([], ["no", " stops"], ("no stops", False)),
    ],
)
def test_matches(stops: list[str], pieces: list[str], expected: tuple[str, bool]) -> None:
    assert run(stops, pieces) == expected


def test_text_is_held_only_while_it_could_still_match() -> None:
    matcher = StopStringMatcher(["world"])
    assert matcher.feed("hello wor") == ("hello ", False)
    assert matcher.feed("k") == ("work", False)
    assert matcher.flush() == ""
