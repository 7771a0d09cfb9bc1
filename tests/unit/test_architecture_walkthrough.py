"""docs/ARCHITECTURE.md's walk-through of one request stays true: every `file.py:name` it
cites names a function, class or method defined in that file, and it needs at most 25 files.

A citation is `path/to/file.py:function`, `path/to/file.py:Class` or
`path/to/file.py:Class.method`, in backquotes, inside the section whose heading starts with
"Walk-through".
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
CITATION = re.compile(r"`([\w/]+\.py):([\w.]+)`")
MAX_FILES = 25


def _walkthrough() -> str:
    text = DOC.read_text()
    start = re.search(r"^(#+) Walk-through", text, re.MULTILINE)
    assert start is not None, "docs/ARCHITECTURE.md has no 'Walk-through' section"
    level = len(start.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(text, start.end())
    return text[start.end() : end.start() if end else len(text)]


def _defined(path: Path) -> set[str]:
    """Top-level functions and classes, and `Class.method` for each class's methods."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    return names


def test_every_citation_names_code_that_exists() -> None:
    citations = CITATION.findall(_walkthrough())
    assert len(citations) >= 20, "the walk-through cites too little to follow a request"
    missing = [
        f"{file}:{name}"
        for file, name in citations
        if not (ROOT / file).is_file() or name not in _defined(ROOT / file)
    ]
    assert not missing, f"the walk-through cites what does not exist: {missing}"


def test_the_walkthrough_needs_at_most_25_files() -> None:
    files = {file for file, _ in CITATION.findall(_walkthrough())}
    assert len(files) <= MAX_FILES, f"{len(files)} files: {sorted(files)}"


def test_a_citation_of_a_missing_name_is_caught(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def f(self): ...\n\nasync def g(): ...\n")
    assert _defined(module) == {"A", "A.f", "g"}
    assert "A.h" not in _defined(module)
