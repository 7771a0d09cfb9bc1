"""The README and docs never show `splitserve up` a flag it refuses: every `splitserve up ...`
command line in them parses with the real parser, and every flag named in the README's
`splitserve up` row of the configuration table is one of `up`'s."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from services.cli import build_parser
from tests.unit.test_deploy_cli import help_flags

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
# `splitserve up ...` in backticks, or a shell line of a code block.
_INLINE = re.compile(r"`(splitserve up\b[^`]*)`")
_SHELL = re.compile(r"^\s*(?:\$ )?((?:\.venv/bin/)?splitserve up\b.*)$", re.M)
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")  # as help_flags reads them


def up_command_lines() -> list[tuple[str, str]]:
    lines: list[tuple[str, str]] = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        found = _INLINE.findall(text) + [m for m in _SHELL.findall(text) if "`" not in m]
        lines += [(path.name, line.split("#")[0].strip()) for line in found]
    return sorted(set(lines))


def test_the_docs_show_up_command_lines():
    assert len(up_command_lines()) >= 3


@pytest.mark.parametrize(("doc", "line"), up_command_lines())
def test_each_up_command_line_parses(doc: str, line: str):
    argv = shlex.split(line)
    argv = argv[argv.index("up") :]
    args = build_parser().parse_args(argv)
    assert args.command == "up", (doc, line)


def test_the_up_row_of_the_configuration_table_names_only_flags_of_up():
    (row,) = (
        line
        for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `splitserve up` |")
    )
    named = set(_FLAG.findall(row))
    assert "--cors-origins" in named
    assert named - help_flags("up") == set()
