"""The errors the engine reports on purpose; anything else it raises is a bug.

`InvalidRequest`: the request (or the data sent for it) can never be served as it is, so the
caller answers 400 naming `field`. `UnknownRequest`: no request of that id is in the state
the operation needs. `OutOfBlocks`: the request is fine but the KV cache is too full right
now, so the caller may retry later or elsewhere.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequest(EngineError):
    """The request is bad: `field` names what, `reason` (also the message) says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


class UnknownRequest(EngineError):
    """No request of this id is in the engine, or not in the state the operation needs."""


class OutOfBlocks(EngineError):
    """The engine has too few free KV blocks for this request right now."""


class BadAdapter(EngineError):
    """A LoRA adapter that cannot be served (missing files, a corrupt or mismatched checkpoint,
    a rank above the limit): the message says which and why; the engine serves on."""
