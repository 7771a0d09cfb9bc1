"""Per-API-key limits on /v1/*: the request body's size, streams in flight, request rate.

- A body over `max_body_bytes` is refused with 413 before it is read (its Content-Length;
  a chunked body is cut off at the same size by aiohttp's `client_max_size`).
- Each API key (or, without keys, all callers together) may have `key_concurrency`
  requests in flight and start `key_rate` per second (a token bucket of `key_burst`);
  beyond either, 429 with Retry-After. 0 turns a limit off.
- The key is found by comparing the bearer token with every configured key in constant
  time (`hmac.compare_digest`, all compared, as the auth check does); the limits are kept
  by the key's position, so no key is ever held in a log line, a metric or an error.
- The caller's tenant (`tenant_of`, passed to the scheduler for fair service) is
  "key-" and the first 16 hex digits of the key's SHA-256: the same on every gateway of the
  mesh, and not the key; "" without keys (every caller one tenant).

`setup_limits(app, config)` installs the middleware (after authentication: a caller with
a wrong key gets 401, not 429) and the state.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NO_KEY = -1  # the caller's slot when the gateway has no API keys


@dataclass(slots=True)
class Bucket:
    """Token bucket: `rate` tokens a second up to `burst`; a request takes one."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until one will be there."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


@dataclass(slots=True)
class KeyLimits:
    keys: tuple[bytes, ...]
    concurrency: int  # 0: unlimited
    rate: float  # requests per second; 0: unlimited
    burst: int
    max_body_bytes: int
    clock: Callable[[], float] = time.monotonic
    in_flight: dict[int, int] = field(default_factory=dict)
    buckets: dict[int, Bucket] = field(default_factory=dict)
    tenants: tuple[str, ...] = field(init=False)  # each key's tenant id, by position

    def __post_init__(self) -> None:
        self.tenants = tuple("key-" + hashlib.sha256(k).hexdigest()[:16] for k in self.keys)

    def slot_of(self, request: web.Request) -> int:
        """The position of the caller's key (NO_KEY without keys); every key is compared."""
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").encode()
        found = NO_KEY
        for i, key in enumerate(self.keys):
            if hmac.compare_digest(given, key):
                found = i
        return found

    def check_body(self, request: web.Request) -> None:
        size = request.content_length
        if size is not None and size > self.max_body_bytes:
            raise ApiError(
                413,
                f"request body of {size} bytes exceeds the {self.max_body_bytes}-byte limit",
                code="request_too_large",
            )

    def admit(self, slot: int) -> None:
        """Count the request in, or raise 429 with how long to wait."""
        if self.concurrency and self.in_flight.get(slot, 0) >= self.concurrency:
            raise ApiError(
                429,
                f"more than {self.concurrency} requests in flight for this API key",
                code="concurrency_limit_exceeded",
                retry_after=1.0,
            )
        if self.rate:
            now = self.clock()
            bucket = self.buckets.setdefault(slot, Bucket(self.rate, self.burst, self.burst, now))
            wait = bucket.take(now)
            if wait:
                raise ApiError(
                    429,
                    f"more than {self.rate:g} requests per second for this API key",
                    code="rate_limit_exceeded",
                    retry_after=math.ceil(wait),
                )
        self.in_flight[slot] = self.in_flight.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        self.in_flight[slot] -= 1


LIMITS = web.AppKey("limits", KeyLimits)


def tenant_of(request: web.Request) -> str:
    """The caller's tenant id ("" without API keys, or outside the gateway's app)."""
    limits = request.app.get(LIMITS)
    if limits is None:
        return ""
    slot = limits.slot_of(request)
    return "" if slot == NO_KEY else limits.tenants[slot]


def setup_limits(app: web.Application, config: GatewayConfig) -> None:
    keys = tuple(k.encode() for k in config.api_keys)
    app[LIMITS] = KeyLimits(
        keys, config.key_concurrency, config.key_rate, config.key_burst, config.max_body_bytes
    )
    app.middlewares.append(_limits)


@web.middleware
async def _limits(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith("/v1/"):
        return await handler(request)
    limits = request.app[LIMITS]
    limits.check_body(request)
    if request.method != "POST":
        return await handler(request)
    slot = limits.slot_of(request)
    limits.admit(slot)
    try:
        return await handler(request)
    finally:
        limits.release(slot)
