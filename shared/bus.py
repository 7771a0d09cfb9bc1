"""The NATS connection every service uses: typed publish / request / subscribe / serve.

- Connects to one URL or a cluster's (comma-separated: it fails over between them) with the
  role's credentials and TLS (`NatsAuth`, shared/nats_options.py), with endless reconnects
  and a short wait between tries; `on_disconnect` and `on_reconnect` callbacks let a
  service react (the scheduler counts a worker's disconnect as a lost heartbeat).
- Messages are `shared.protocol` dataclasses; a frame that does not decode or breaks a
  bound (shared/wire_checks.py) is counted and logged (`rejections`) and dropped, or
  answered with an error for request/reply, never a crash of the service.
- Headers carry the W3C `traceparent`: callers pass `headers=`; handlers receive them.
- `close()` drains: in-flight handlers finish, then the connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.nats_options import NatsAuth, connect_options
from shared.wire_checks import decode_checked, decode_checked_one_of
from shared.wire_codec import WireError, encode
from shared.wire_rejections import WireRejections

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSE_TIMEOUT_S = 5.0  # draining a connection at shutdown takes at most this
Headers = dict[str, str]


class Bus:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.rejections = WireRejections()

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        on_disconnect: Callable[[], Awaitable[None]] | None = None,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
        connect_timeout: float = 10.0,
        auth: NatsAuth | None = None,
    ) -> Bus:
        """Connect to `url` (one or several, comma-separated) as `auth`'s user (None:
        anonymous); every failure, refused credentials included, is retried until
        `connect_timeout`, then raises ConnectionError."""
        options = connect_options(url, auth or NatsAuth())

        async def disconnected() -> None:
            log.warning("%s: disconnected from NATS", name)
            if on_disconnect:
                await on_disconnect()

        async def reconnected() -> None:
            log.warning("%s: reconnected to NATS", name)
            if on_reconnect:
                await on_reconnect()

        async def error(exc: Exception) -> None:
            denied = "permissions violation" in str(exc).lower()  # a subject outside the role's
            log.log(logging.WARNING if denied else logging.DEBUG, "%s: NATS error: %s", name, exc)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout
        while True:  # the first connection too is retried, so start order does not matter
            connecting = nats.connect(
                **options,
                name=name,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                ping_interval=5,
                max_outstanding_pings=2,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
            )
            try:  # nats-py itself retries a refused first connection for ever: bounded here
                nc = await asyncio.wait_for(connecting, max(0.1, deadline - loop.time()))
                return cls(nc)
            except Exception as exc:
                if loop.time() >= deadline:
                    why = f"{exc}" or type(exc).__name__
                    raise ConnectionError(f"{name}: cannot reach NATS at {url}: {why}") from exc
                await asyncio.sleep(0.5)

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def publish(self, subject: str, message: Any, headers: Headers | None = None) -> None:
        await self.nc.publish(subject, encode(message), headers=headers)

    async def request(
        self,
        subject: str,
        message: Any,
        reply_type: type[T],
        timeout: float,
        headers: Headers | None = None,
    ) -> T:
        """Send and wait for one typed reply; raises TimeoutError, NoRespondersError,
        or WireError when the reply does not decode."""
        reply = await self.nc.request(subject, encode(message), timeout=timeout, headers=headers)
        try:
            return decode_checked(reply.data, reply_type)
        except WireError as exc:
            self.rejections.reject(subject, exc)
            raise

    async def subscribe(
        self,
        subject: str,
        message_type: type[T] | tuple[type, ...],
        handler: Callable[[T, Headers], Awaitable[None]],
        queue: str = "",
    ) -> Subscription:
        """Call `handler` with each message; `message_type` may be a tuple of the types a
        subject carries (the events subject: RequestFailed or WorkerLost)."""

        async def on_message(msg: Msg) -> None:
            try:
                if isinstance(message_type, tuple):
                    message = decode_checked_one_of(msg.data, *message_type)
                else:
                    message = decode_checked(msg.data, message_type)
            except WireError as exc:
                self.rejections.reject(msg.subject, exc)
                return
            try:
                await handler(message, msg.headers or {})
            except Exception:
                log.exception("handler for %s failed", msg.subject)

        return await self.nc.subscribe(subject, queue=queue, cb=on_message)

    async def serve(
        self,
        subject: str,
        request_type: type[T],
        handler: Callable[[T, Headers], Awaitable[Any]],
        on_bad_request: Callable[[str], Any],
        queue: str = "",
        concurrent: bool = False,
    ) -> Subscription:
        """Answer requests: the handler's return value is the reply. A request that does not
        decode is answered with `on_bad_request(reason)`, so the caller learns at once.
        nats-py runs one subscription's callbacks one at a time; `concurrent=True` answers
        each request in its own task, so a slow one does not hold up those behind it."""

        async def answer(msg: Msg) -> None:
            try:
                message = decode_checked(msg.data, request_type)
            except WireError as exc:
                self.rejections.reject(msg.subject, exc)
                reply = on_bad_request(str(exc))
            else:
                try:
                    reply = await handler(message, msg.headers or {})
                except Exception as exc:
                    log.exception("handler for %s failed", msg.subject)
                    reply = on_bad_request(f"internal error: {exc}")
            if msg.reply:
                await msg.respond(encode(reply))

        tasks: set[asyncio.Task] = set()

        async def on_message(msg: Msg) -> None:
            if not concurrent:
                await answer(msg)
                return
            task = asyncio.create_task(answer(msg))
            tasks.add(task)  # keep a reference until it is done
            task.add_done_callback(tasks.discard)

        return await self.nc.subscribe(subject, queue=queue, cb=on_message)

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Drain (subscriptions answered, publishes flushed), within `timeout`; a connection
        that is down (the server gone, reconnecting) is closed as it is, never raising."""
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout)
        except Exception:  # down, or too slow: nothing more can be delivered
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), timeout)
