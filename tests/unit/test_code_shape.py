"""The shape the product code keeps: no import circles, no code file over 350 lines.

Every import statement counts — those inside functions and `TYPE_CHECKING` blocks too — so a
circle cannot be dodged by moving an import into a function. A package's `__init__` that
re-exports its own modules is no circle of ideas: its edges to its children are left out.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "loadtest")
MAX_LINES = 350


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, package):
                while target and target not in modules:  # the longest module it names
                    target = target.rpartition(".")[0]
                is_child = path.name == "__init__.py" and target.startswith(name + ".")
                if target and target != name and not is_child:
                    edges.add(target)
    return graph


def test_no_import_circles() -> None:
    try:
        TopologicalSorter(_import_graph()).prepare()
    except CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None


def test_imports_in_functions_and_type_checking_blocks_count() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from shared.protocol import Heartbeat\n"
        "def late():\n    from . import routing\n    import shared.bus\n"
    )
    found = [
        name
        for node in ast.walk(ast.parse(source))
        for name in _imported(node, "services.scheduler")
    ]
    assert {"shared.protocol", "services.scheduler.routing", "shared.bus"} <= set(found)


def test_no_code_file_over_350_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in _modules().values()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"code files over {MAX_LINES} lines: {long}"
