"""The gateway's guided-regex check agrees with xgrammar: every construct it refuses with a
400 is one xgrammar's regex converter rejects, and what it lets through compiles."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from services.gateway.errors import ApiError
from services.gateway.structured import _regex

REFUSED = {
    r"(?=a)b": "lookarounds",
    r"x(?!a)": "negative lookarounds",
    r"(?<=a)b": "lookarounds",
    r"(a)\1": "backreferences",
    r"(a)(?(1)b|c)": "conditional groups",
    r"(?>a)b": "atomic groups",
    r"a++": "possessive repeats",
    r"\bfoo": "word boundaries",
    r"(?i)abc": "inline flags",
    r"(?s:a.)": "inline flags",
    r"(?P<x>a)": "named groups",
    r"(a|b(?=c))+": "lookarounds",
}
ACCEPTED = [r"(?:ab)+", r"(a)b", r"\w+@\w+\.com", r"a{2,}", r"[\w.-]+", r"\d+\.\d*", r"a*?"]


@pytest.mark.parametrize("pattern", sorted(REFUSED))
def test_refused_regexes_are_400_and_xgrammar_rejects_them_too(pattern: str) -> None:
    with pytest.raises(ApiError) as caught:
        _regex(pattern, "guided_regex")
    assert caught.value.status == 400 and caught.value.param == "guided_regex"
    assert REFUSED[pattern] in str(caught.value)
    with pytest.raises(RuntimeError):
        xgr.Grammar.from_regex(pattern)


@pytest.mark.parametrize("pattern", ACCEPTED)
def test_accepted_regexes_compile_in_xgrammar(pattern: str) -> None:
    assert _regex(pattern, "guided_regex") == pattern
    xgr.Grammar.from_regex(pattern)
