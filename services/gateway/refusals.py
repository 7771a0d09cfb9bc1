"""How a request is turned down or fails, as domain values: `Refused` and `GenerationFailed`.

`Refused`: a target did not take the request and nothing was sent to the client; its
`Outcome` says why (BUSY, UNAVAILABLE, FAILED: a later try, or another target, may take it;
INVALID: none will). `GenerationFailed`: an accepted request failed before its reply ended;
its `Failure` says why. Retry (model_client.retrying) and fallback (chain.py) decide on
these values. Subtle rule: neither knows HTTP; errors.py turns them into the client's
status and body at the edge, and an upstream's own status travels in `UpstreamUnavailable`
only to be passed on as is.
"""

from __future__ import annotations

from enum import IntEnum

from shared.protocol import Outcome

TRY_AGAIN = frozenset({Outcome.BUSY, Outcome.UNAVAILABLE, Outcome.FAILED})
_UPSTREAM_OUTCOMES = {429: Outcome.BUSY, 502: Outcome.UNAVAILABLE, 503: Outcome.UNAVAILABLE,
                      504: Outcome.UNAVAILABLE}  # fmt: skip


class Refused(Exception):
    """A target did not take the request (nothing has been sent to the client)."""

    def __init__(self, outcome: Outcome, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.retry_after = retry_after  # seconds to wait before asking again, when it says

    @property
    def may_try_again(self) -> bool:
        """A later try, or another target, may take the request."""
        return self.outcome in TRY_AGAIN


class UpstreamUnavailable(Refused):
    """An external upstream did not serve the request: `status` is its answer (429 or 5xx),
    or 502 (unreachable) or 504 (silent). 429, 502, 503 and 504 say it is busy or away; any
    other 5xx is its own error about this request, which no other target is asked to repeat."""

    def __init__(self, message: str, status: int, code: str = "upstream_unavailable") -> None:
        super().__init__(_UPSTREAM_OUTCOMES.get(status, Outcome.FAILED), message)
        self.status = status
        self.code = code  # the error's `code` for the client

    @property
    def may_try_again(self) -> bool:
        return self.status in _UPSTREAM_OUTCOMES


class Failure(IntEnum):
    """Why an accepted request failed."""

    LOST = 1  # an attempt failed (error chunk, lost worker, abort) and migration gave up
    TIMED_OUT = 2  # no token within the stall timeout (migration gave up), or the deadline
    UNPLACED = 3  # a migrated attempt found no worker in time
    REFUSED = 4  # a sibling choice was refused (`GenerationFailed.refused` says how)


class GenerationFailed(Exception):
    """An accepted request failed before its reply ended."""

    def __init__(self, message: str, failure: Failure, refused: Refused | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.refused = refused  # for Failure.REFUSED

    @property
    def may_try_again(self) -> bool:
        """Another target may serve the request (when nothing has been sent to the client)."""
        return self.refused is None or self.refused.may_try_again
