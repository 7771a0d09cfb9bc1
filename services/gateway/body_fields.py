"""Typed reads of request-body fields: each a 400 naming the field when its type is wrong."""

from __future__ import annotations

from typing import Any

from services.gateway.errors import invalid


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if not is_int(value):
        raise invalid(f"{name} must be an integer", name)
    return value


def int_list_field(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name, [])
    if not (isinstance(value, list) and all(is_int(v) for v in value)):
        raise invalid(f"{name} must be a list of integers", name)
    return value


def float_field(body: dict[str, Any], name: str, default: float, param: str | None = None) -> float:
    value = body.get(name, default)
    if not (isinstance(value, int | float) and not isinstance(value, bool)):
        raise invalid(f"{param or name} must be a number", param or name)
    return float(value)


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false", name)
    return value
