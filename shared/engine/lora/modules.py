"""`--lora-modules name=path …`: the adapters a worker knows from its start, parsed without
touching the disk (EngineConfig is pure; the files are read when the engine starts).

The one rule: an adapter name is also a model name on the OpenAI API (`model`), so it is
a plain token (letters, digits, `._-/:`), never empty, and never repeated.
"""

from __future__ import annotations

import re
from pathlib import Path

from shared.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:]{0,127}")


def adapter_name_error(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if _NAME.fullmatch(name):
        return None
    return f"adapter name {name!r}: 1-128 of letters, digits and ._-/: (a letter or digit first)"


def parse_lora_modules(entries: tuple[str, ...]) -> dict[str, Path]:
    """("name=path", …) -> {name: path}, in order; ConfigError naming a bad entry."""
    modules: dict[str, Path] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not path:
            raise ConfigError(f"lora module {entry!r}: expected name=path")
        if (reason := adapter_name_error(name)) is not None:
            raise ConfigError(reason)
        if name in modules:
            raise ConfigError(f"lora module {name!r} is given twice")
        modules[name] = Path(path)
    return modules
