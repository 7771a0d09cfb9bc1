"""Strict msgpack encoding of wire dataclasses: what `shared/protocol.py` messages ride on.

A frame is the msgpack array `[schema_version, type_name, {field: value}]`. Decoding checks
the version, the expected type, that every field is present and of its annotated type
(nested dataclasses, lists, dicts, optionals, int enums), and that no unknown field appears — and
raises `WireError` with the field's name rather than crashing the receiving service. No
list may hold more than `MAX_LIST_ITEMS`: a huge array is refused before it is walked.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, TypeVar

import msgpack

# 2: one `Outcome` enum in every answer instead of ok/invalid flags; 3: prompt logprobs
# (SamplingParams.prompt_logprobs, TokenChunk.prompt_logprobs)
SCHEMA_VERSION = 3
MAX_FRAME_BYTES = 64 * 2**20  # no message, KV chunks included, may exceed this
MAX_LIST_ITEMS = 1 << 20  # no list in a message is longer: refused before it is walked

T = TypeVar("T")


class WireError(ValueError):
    """A frame that does not decode into the expected message."""


def encode(message: Any) -> bytes:
    frame = [SCHEMA_VERSION, type(message).__name__, _to_plain(message)]
    data = msgpack.packb(frame, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"{type(message).__name__} is {len(data)} bytes (limit {MAX_FRAME_BYTES})")
    return data


def decode(data: bytes, cls: type[T]) -> T:
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(data)} bytes exceeds the {MAX_FRAME_BYTES} limit")
    try:
        frame = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise WireError(f"not a msgpack frame: {exc}") from None
    if not (isinstance(frame, list) and len(frame) == 3):
        raise WireError("frame must be [version, type, fields]")
    version, name, fields = frame
    if version != SCHEMA_VERSION:
        raise WireError(f"schema version {version!r} (this service speaks {SCHEMA_VERSION})")
    if name != cls.__name__:
        raise WireError(f"expected a {cls.__name__}, got {name!r}")
    return _from_plain(fields, cls, cls.__name__)


def _to_plain(value: Any) -> Any:
    if isinstance(value, enum.IntEnum):
        return int(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


@functools.cache
def _shape(cls: type) -> tuple[tuple[dataclasses.Field, ...], dict[str, Any], frozenset[str]]:
    """A wire dataclass's fields, their type hints and names, resolved once per class (the
    hints of string annotations cost more to resolve than a small message to decode)."""
    fields = dataclasses.fields(cls)
    return fields, typing.get_type_hints(cls), frozenset(f.name for f in fields)


def _from_plain(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected an object")
        fields, hints, names = _shape(hint)
        unknown = value.keys() - names
        if unknown:
            raise WireError(f"{where}: unknown field(s) {sorted(unknown)}")
        kwargs = {}
        for f in fields:
            if f.name not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise WireError(f"{where}.{f.name}: missing")
                continue
            kwargs[f.name] = _from_plain(value[f.name], hints[f.name], f"{where}.{f.name}")
        try:
            return hint(**kwargs)
        except (TypeError, ValueError) as exc:  # the dataclass's own checks
            raise WireError(f"{where}: {exc}") from None
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _from_plain(value, option, where)
            except WireError:
                continue
        raise WireError(f"{where}: {type(value).__name__} matches none of {hint}")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list")
        if len(value) > MAX_LIST_ITEMS:
            raise WireError(f"{where}: {len(value)} items (at most {MAX_LIST_ITEMS})")
        args = typing.get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed shape: tuple[int, float]
            if len(value) != len(args):
                raise WireError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(
                _from_plain(v, a, f"{where}[{i}]")
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        item = args[0] if args else Any
        items = [_from_plain(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected a map")
        key_type, value_type = typing.get_args(hint)
        return {
            _from_plain(k, key_type, f"{where} key"): _from_plain(v, value_type, f"{where}[{k}]")
            for k, v in value.items()
        }
    if hint is Any:
        return value
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"{where}: expected {hint.__name__} (an int)")
        try:
            return hint(value)
        except ValueError:
            raise WireError(f"{where}: {value} is no {hint.__name__}") from None
    if hint is type(None):
        if value is not None:
            raise WireError(f"{where}: expected null")
        return None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise WireError(f"{where}: expected {hint.__name__}, got bool")
    if not isinstance(value, hint):
        raise WireError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def decode_one_of(data: bytes, *classes: type) -> Any:
    """Decode a frame that may hold any of `classes` (e.g. the events subject)."""
    try:
        name = msgpack.unpackb(data, raw=False, strict_map_key=False)[1]
    except Exception:
        raise WireError("not a [version, type, fields] frame") from None
    for cls in classes:
        if cls.__name__ == name:
            return decode(data, cls)
    raise WireError(f"unexpected message type {name!r}")
