"""Typed reads of a YAML node tree that keep the line of every value, so each error in a
mesh config names the line it is on (`file.yaml:12: weight must be > 0, got 0`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode


class MeshConfigError(Exception):
    """A mesh config that cannot be served; the message starts with `file:line:`."""


class Reader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._constructor = yaml.SafeLoader("")  # builds Python values from scalar nodes

    def error(self, node: Node, message: str) -> MeshConfigError:
        return self.error_at(node.start_mark.line + 1, message)

    def error_at(self, line: int, message: str) -> MeshConfigError:
        return MeshConfigError(f"{self.path}:{line}: {message}")

    def mapping(
        self,
        node: Node,
        what: str,
        required: Sequence[str] = (),
        optional: Sequence[str] | None = (),
        normalize: bool = False,
    ) -> dict[str, Node]:
        """A mapping's values by key; unknown keys (when `optional` is not None), missing
        required ones and duplicates are errors. `normalize`: dashes in keys read as `_`."""
        if not isinstance(node, MappingNode):
            raise self.error(node, f"{what} must be a mapping (key: value)")
        fields: dict[str, Node] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node, "a key")
            if not isinstance(key, str):
                raise self.error(key_node, f"{what}: keys must be names, not {key!r}")
            key = key.replace("-", "_") if normalize else key
            if key in fields:
                raise self.error(key_node, f"{what}: {key} is given twice")
            if optional is not None and key not in (*required, *optional):
                known = ", ".join(sorted((*required, *optional)))
                raise self.error(key_node, f"{what}: unknown key {key!r} (known: {known})")
            fields[key] = value_node
        for key in required:
            if key not in fields:
                raise self.error(node, f"{what} needs {key}")
        return fields

    def sequence(self, node: Node | None, what: str, min_len: int = 0) -> list[Node]:
        if node is None or (isinstance(node, ScalarNode) and node.tag.endswith(":null")):
            items: list[Node] = []
        elif isinstance(node, SequenceNode):
            items = list(node.value)
        else:
            raise self.error(node, f"{what} must be a list")
        if len(items) < min_len:
            raise self.error_at(_line(node), f"{what} must list at least {min_len}")
        return items

    def scalar(self, node: Node, what: str) -> object:
        """A scalar's value (str, int, float, bool, None), or a list of scalars."""
        if isinstance(node, SequenceNode):
            return [self.scalar(item, what) for item in node.value]
        if not isinstance(node, ScalarNode):
            raise self.error(node, f"{what} must be a single value")
        return self._constructor.construct_object(node, deep=True)

    def text(self, node: Node, what: str) -> str:
        value = self.scalar(node, what)
        if not isinstance(value, str) or not value.strip():
            raise self.error(node, f"{what} must be a non-empty string, got {value!r}")
        return value

    def name(self, node: Node, what: str) -> str:
        value = self.text(node, what)
        if any(c.isspace() for c in value):
            raise self.error(node, f"{what} must be a name without spaces, got {value!r}")
        return value

    def integer(self, node: Node, what: str, minimum: int) -> int:
        value = self.scalar(node, what)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(node, f"{what} must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, node: Node, what: str, positive: bool) -> float:
        value = self.scalar(node, what)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (positive and value <= 0)
        ):
            raise self.error(node, f"{what} must be a number > 0, got {value!r}")
        return float(value)


def _line(node: Node | None) -> int:
    return node.start_mark.line + 1 if node is not None else 1
