"""How an engine error answers a request for work: the engine's own errors by kind, and
anything else as an internal failure (logged), so a bug is never taken for a bad request."""

from __future__ import annotations

import logging

from shared.engine.errors import EngineError, InvalidRequest, OutOfBlocks
from shared.protocol import Outcome

log = logging.getLogger(__name__)


def refusal(request_id: str, exc: Exception) -> tuple[Outcome, str]:
    """(outcome, error) for an exception the engine raised while taking `request_id`."""
    if isinstance(exc, InvalidRequest):
        return Outcome.INVALID, str(exc)
    if isinstance(exc, OutOfBlocks):
        return Outcome.BUSY, str(exc)
    if not isinstance(exc, EngineError):
        log.error("%s: internal error in the engine", request_id, exc_info=exc)
    return Outcome.FAILED, f"internal error: {exc}"
