"""ApiError: what the client sees, in the OpenAI shape {"error": {message, type, param, code}}.

`api_error` is the one place where a refusal or a failed generation (refusals.py) becomes
an HTTP status: the statuses below are what clients (and tests) see, and every 429 and 503
carries Retry-After (docs/reliability.md, "Limits").
"""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from services.gateway.refusals import Failure, GenerationFailed, Refused, UpstreamUnavailable
from shared.protocol import Outcome

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
STATUS_BY_OUTCOME = {Outcome.INVALID: 400, Outcome.BUSY: 429, Outcome.UNAVAILABLE: 503,
                     Outcome.FAILED: 503}  # fmt: skip
STATUS_BY_FAILURE = {Failure.LOST: 502, Failure.UNPLACED: 503, Failure.TIMED_OUT: 504}
RETRY_AFTER_S = 1.0  # a 429 or 503 whose refusal gave no advice


class ApiError(Exception):
    """Raised anywhere in request handling; the middleware turns it into a JSON response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": TYPE_BY_STATUS.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return web.json_response(self.body(), status=self.status, headers=headers)


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 naming the offending field."""
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def api_error(exc: Refused | GenerationFailed) -> ApiError:
    """The client's answer to a refusal or a failed generation; a 429 or 503 always says
    when to try again (Retry-After: the refusal's advice, else `RETRY_AFTER_S`)."""
    error = _api_error(exc)
    if error.status in (429, 503) and error.retry_after is None:
        error.retry_after = RETRY_AFTER_S
    return error


def _api_error(exc: Refused | GenerationFailed) -> ApiError:
    if isinstance(exc, GenerationFailed):
        if exc.refused is None:
            return ApiError(STATUS_BY_FAILURE[exc.failure], str(exc), code="generation_failed")
        refused = api_error(exc.refused)
        return ApiError(
            refused.status, str(exc), code="generation_failed", retry_after=refused.retry_after
        )
    if isinstance(exc, UpstreamUnavailable):  # the upstream's own status, passed on
        return ApiError(exc.status, exc.message, code=exc.code)
    return ApiError(STATUS_BY_OUTCOME[exc.outcome], exc.message, retry_after=exc.retry_after)
