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
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

# 2: one `Outcome` enum in every answer instead of ok/invalid flags; 3: prompt logprobs
# (SamplingParams.prompt_logprobs, TokenChunk.prompt_logprobs); 4: `TokenChunk.finish_reason`
# a `FinishReason` IntEnum instead of a string
SCHEMA_VERSION = 4
MAX_FRAME_BYTES = 64 * 2**20  # no message, KV chunks included, may exceed this
MAX_LIST_ITEMS = 1 << 20  # no list in a message is longer: refused before it is walked

T = TypeVar("T")


class WireError(ValueError):
    """A frame that does not decode into the expected message."""


def encode(message: Any) -> bytes:
    frame = [SCHEMA_VERSION, type(message).__name__, _encoder(type(message))(message)]
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
        raise WireError(
            f"schema version {version!r}: this service speaks {SCHEMA_VERSION} "
            "(every service of a mesh runs the same splitserve version)"
        )
    if name != cls.__name__:
        raise WireError(f"expected a {cls.__name__}, got {name!r}")
    try:
        return _decoder(cls)(fields)
    except _Mismatch as bad:
        raise WireError(f"{cls.__name__}{''.join(reversed(bad.path))}: {bad.message}") from None


# Encoding and decoding are compiled once per type hint into functions: a message's fields
# are walked by plans made from its class, not by inspecting every value (a 100-token prompt
# is one type check of its list, not 100 recursive calls).
Convert = Callable[[Any], Any]
# msgpack packs these (and IntEnums) as they are
_PLAIN = (int, float, str, bool, bytes, type(None))


class _Mismatch(Exception):
    """A value that does not fit its hint. The path to it (".field", "[3]") is collected as the
    error unwinds, so a frame that decodes builds no path strings."""

    def __init__(self, message: str, step: str | None = None) -> None:
        self.message = message
        self.path: list[str] = [] if step is None else [step]


def _unchanged(value: Any) -> Any:
    return value


def _to_plain(value: Any) -> Any:
    """Any value of an `Any` field: dataclasses to maps and IntEnums to ints, at any depth."""
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


@functools.cache
def _encoder(hint: Any) -> Convert:
    """The function that turns a value of `hint` into what msgpack packs (`_unchanged` where
    msgpack takes it as it is)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        plan: list[tuple[str, Convert]] | None = None

        def to_map(value: Any) -> dict[str, Any]:
            nonlocal plan
            if plan is None:  # made on first use: a class may name itself among its fields
                fields, hints, _ = _shape(hint)
                plan = [(f.name, _encoder(hints[f.name])) for f in fields]
            return {name: convert(getattr(value, name)) for name, convert in plan}

        return to_map
    if hint in _PLAIN or (isinstance(hint, type) and issubclass(hint, enum.IntEnum)):
        return _unchanged
    if origin in (list, tuple, dict, typing.Union, types.UnionType):
        parts = [_encoder(a) for a in args if a is not Ellipsis]
        if parts and all(part is _unchanged for part in parts):
            return _unchanged
        if origin in (list, tuple) and len(parts) == 1:
            item = parts[0]
            return lambda value: [item(v) for v in value]
    return _to_plain


@functools.cache
def _decoder(hint: Any) -> Convert:
    """The function that checks a decoded value against `hint` and builds the field's value
    from it, raising `_Mismatch`."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _dataclass_decoder(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(hint)
    if origin in (list, tuple):
        return _sequence_decoder(hint, origin)
    if origin is dict:
        return _map_decoder(hint)
    if hint is Any:
        return _unchanged
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return _enum_decoder(hint)
    if hint is type(None):
        return _null
    return _scalar_decoder(hint)


def _dataclass_decoder(cls: type) -> Convert:
    plan: list[tuple[str, Convert, bool]] | None = None  # (name, decoder, required)
    names: frozenset[str] = frozenset()

    def decode_object(value: Any) -> Any:
        nonlocal plan, names
        if not isinstance(value, dict):
            raise _Mismatch("expected an object")
        if plan is None:  # made on first use: a class may name itself among its fields
            fields, hints, names = _shape(cls)
            plan = [(f.name, _decoder(hints[f.name]), _required(f)) for f in fields]
        unknown = value.keys() - names
        if unknown:
            raise _Mismatch(f"unknown field(s) {sorted(unknown)}")
        kwargs = {}
        for name, decode_field, required in plan:
            if name in value:
                try:
                    kwargs[name] = decode_field(value[name])
                except _Mismatch as bad:
                    bad.path.append(f".{name}")
                    raise
            elif required:
                raise _Mismatch("missing", f".{name}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:  # the dataclass's own checks
            raise _Mismatch(str(exc)) from None

    return decode_object


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _union_decoder(hint: Any) -> Convert:
    options = typing.get_args(hint)
    decoders = [_decoder(option) for option in options]
    nullable = type(None) in options

    def decode_union(value: Any) -> Any:
        if value is None and nullable:
            return None
        for decode_option in decoders:
            try:
                return decode_option(value)
            except _Mismatch:
                continue
        raise _Mismatch(f"{type(value).__name__} matches none of {hint}")

    return decode_union


def _sequence_decoder(hint: Any, origin: type) -> Convert:
    args = typing.get_args(hint)
    fixed = origin is tuple and bool(args) and args[-1] is not Ellipsis  # tuple[int, float]
    decoders = [_decoder(a) for a in args] if fixed else [_decoder(args[0] if args else Any)]
    exact = args[0] if not fixed and args and args[0] in (int, float, str, bytes) else None

    def each(value: list) -> list:
        """The items decoded; a mismatch names its index."""
        pairs = zip(value, decoders, strict=True) if fixed else ((v, decoders[0]) for v in value)
        items = []
        for i, (v, decode_item) in enumerate(pairs):
            try:
                items.append(decode_item(v))
            except _Mismatch as bad:
                bad.path.append(f"[{i}]")
                raise
        return items

    def decode_sequence(value: Any) -> Any:
        if not isinstance(value, list):
            raise _Mismatch("expected a list")
        if len(value) > MAX_LIST_ITEMS:
            raise _Mismatch(f"{len(value)} items (at most {MAX_LIST_ITEMS})")
        if fixed and len(value) != len(args):
            raise _Mismatch(f"expected {len(args)} items, got {len(value)}")
        # every item already of the exact type (a bool is no int here): the list as it is
        fast = exact is not None and (not value or set(map(type, value)) == {exact})
        items = value if fast else each(value)
        return tuple(items) if origin is tuple else items

    return decode_sequence


def _map_decoder(hint: Any) -> Convert:
    key_type, value_type = typing.get_args(hint)
    decode_key, decode_value = _decoder(key_type), _decoder(value_type)

    def decode_map(value: Any) -> dict:
        if not isinstance(value, dict):
            raise _Mismatch("expected a map")
        out = {}
        for k, v in value.items():
            try:
                key = decode_key(k)
            except _Mismatch as bad:
                bad.path.append(" key")
                raise
            try:
                out[key] = decode_value(v)
            except _Mismatch as bad:
                bad.path.append(f"[{k}]")
                raise
        return out

    return decode_map


def _enum_decoder(hint: type[enum.IntEnum]) -> Convert:
    def decode_enum(value: Any) -> enum.IntEnum:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch(f"expected {hint.__name__} (an int)")
        try:
            return hint(value)
        except ValueError:
            raise _Mismatch(f"{value} is no {hint.__name__}") from None

    return decode_enum


def _null(value: Any) -> None:
    if value is not None:
        raise _Mismatch("expected null")


def _scalar_decoder(hint: type) -> Convert:
    def decode_scalar(value: Any) -> Any:
        if type(value) is hint:
            return value
        if hint is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if hint in (int, float) and isinstance(value, bool):
            raise _Mismatch(f"expected {hint.__name__}, got bool")
        if not isinstance(value, hint):
            raise _Mismatch(f"expected {hint.__name__}, got {type(value).__name__}")
        return value

    return decode_scalar


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
