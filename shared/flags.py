"""Command-line flags generated from a dataclass, so each setting is declared once.

A field opts in with `flag(...)`: its default, help text, choices, a flag name when it is
not `--<field-name>`, and its environment variable when that is not `SPLITSERVE_<FIELD>`
(or None: the flag has none). `add_flags` turns each such field into an argparse flag whose
default is the variable's value when that is set, `build` makes the dataclass back from the
parsed namespace, and `changed_argv` writes the values that differ from their defaults as
the arguments of a child process (how `splitserve up` configures its services).

The flag's type comes from the field's annotation: `int`, `float`, `str`, `Path`, `bool`
(`--x` / `--no-x`), `X | None` (unset: None) and `tuple[str, ...]` (comma-separated,
repeatable, with `spaced` space-separated too; the variable is comma-separated).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, TypeVar

from shared.errors import ConfigError

T = TypeVar("T")
_KEY = "splitserve.flag"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_METAVARS = {int: "N", float: "X", str: "TEXT", Path: "DIR", tuple: "A,B"}


@dataclass(frozen=True, slots=True)
class Flag:
    help: str
    choices: tuple[str, ...] | None = None
    name: str = ""  # the option string; "": --<field name with dashes>
    # The flag's default where it differs from the field's: a value the CLI replaces later,
    # such as "" for a name that defaults to the model directory's. Used when `has_unset`.
    unset: object = None
    has_unset: bool = False
    variable: str | None = ""  # the environment variable; "": SPLITSERVE_<FIELD>; None: none
    spaced: bool = False  # a tuple flag that takes space-separated values too (`--x a b`)

    def option(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")


def flag(
    default: object = MISSING,
    *,
    help: str,
    choices: tuple[str, ...] | None = None,
    name: str = "",
    unset: object = MISSING,
    variable: str | None = "",
    spaced: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag (and a `SPLITSERVE_*` variable)."""
    spec = Flag(help, choices, name, unset, unset is not MISSING, variable, spaced)
    return dataclasses.field(default=default, metadata={_KEY: spec})


@dataclass(frozen=True, slots=True)
class Setting:
    """One flagged field, its annotation resolved."""

    name: str
    spec: Flag
    kind: type  # int | float | str | Path | bool | tuple
    default: object  # MISSING: the flag is required unless its variable is set

    @property
    def option(self) -> str:
        return self.spec.option(self.name)

    @property
    def variable(self) -> str | None:
        if self.spec.variable == "":
            return f"SPLITSERVE_{self.name.upper()}"
        return self.spec.variable

    @property
    def env_default(self) -> object:
        """The flag's default: its variable's value when that is set, else the field's."""
        if self.variable is None:
            return self.default
        return env(self.variable, self.default, self.parse)

    def parse(self, raw: str) -> object:
        """A variable's text as a value of the field; ConfigError saying why not."""
        if self.kind is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"expected one of {_TRUE + _FALSE}")
            return raw.lower() in _TRUE
        if self.kind is tuple:
            return _items(raw)
        try:
            value = self.kind(raw)
        except ValueError as exc:  # int("many"): the text, not a bug
            raise ConfigError(str(exc)) from None
        if self.spec.choices and value not in self.spec.choices:
            raise ConfigError(f"expected one of {self.spec.choices}")
        return value


def settings(cls: type, skip: Sequence[str] = ()) -> list[Setting]:
    """The flagged fields of dataclass `cls` but `skip`."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        spec = field.metadata.get(_KEY)
        if spec is None or field.name in skip:
            continue
        default = spec.unset if spec.has_unset else field.default
        found.append(Setting(field.name, spec, _kind(hints[field.name]), default))
    return found


def flag_names(cls: type) -> tuple[str, ...]:
    """The fields of `cls` that are flags."""
    return tuple(s.name for s in settings(cls))


def add_flags(
    parser: argparse._ActionsContainer,
    cls: type,
    skip: Sequence[str] = (),
) -> None:
    """One flag per flagged field of `cls`, defaulting to its `SPLITSERVE_*` variable."""
    for setting in settings(cls, skip):
        default = setting.env_default
        variable = f" [{setting.variable}]" if setting.variable else ""
        help_text = setting.spec.help + variable
        options: dict[str, Any] = {"dest": setting.name, "help": help_text}
        if default is MISSING:
            options["required"] = True
        else:
            options["default"] = default
        if setting.kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif setting.kind is tuple:
            options["action"] = _Items
            options["nargs"] = "+" if setting.spec.spaced else None
        else:
            options |= {"type": setting.kind, "choices": setting.spec.choices}
        if setting.kind is not bool and not setting.spec.choices:
            options["metavar"] = _METAVARS[setting.kind]
        parser.add_argument(setting.option, **options)


def build(cls: Callable[..., T], args: argparse.Namespace, **overrides: object) -> T:
    """`cls` from the parsed flags of its fields, and `overrides` (which win)."""
    values = {s.name: getattr(args, s.name) for s in settings(cls) if hasattr(args, s.name)}
    return cls(**(values | overrides))


def changed_argv(
    cls: type,
    args: argparse.Namespace,
    skip: Sequence[str] = (),
) -> tuple[str, ...]:
    """The flags of `cls` in `args` whose values differ from their defaults, as arguments
    that a parser built by `add_flags(parser, cls, skip)` reads back."""
    argv: list[str] = []
    for setting in settings(cls, skip):
        if not hasattr(args, setting.name):
            continue
        value = getattr(args, setting.name)
        if value is None or value == setting.env_default:
            continue
        if setting.kind is bool:
            argv.append(setting.option if value else "--no-" + setting.option[2:])
        elif setting.kind is tuple:
            argv += [setting.option, ",".join(value)]
        else:
            value = value.resolve() if isinstance(value, Path) else value
            argv += [setting.option, str(value)]
    return tuple(argv)


def env(variable: str, default: T, parse: Callable[[str], T] = str) -> T:
    """Environment variable `variable` parsed, or `default` when it is unset or empty; a
    value that does not parse exits naming the variable."""
    raw = os.environ.get(variable)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise SystemExit(f"{variable}={raw!r}: {exc}") from None


def _kind(hint: object) -> type:
    """The flag's type for a field annotation (`X | None`: X's)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and type(None) in args:
        (hint,) = (a for a in args if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return tuple
    if hint in (int, float, str, Path, bool):
        return typing.cast(type, hint)
    raise TypeError(f"no flag type for the annotation {hint!r}")


def _items(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


class _Items(argparse.Action):
    """A comma-separated, repeatable flag: the first use replaces the default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        current = () if current is self.default else current
        given = values if isinstance(values, list) else [str(values)]
        setattr(namespace, self.dest, (*current, *(i for v in given for i in _items(v))))
