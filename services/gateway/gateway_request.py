"""`GatewayRequest`: one request on the mesh and every attempt of it, in one object.

A request is submitted as attempt 0 under its own id; each migration (migration.py) makes
the next attempt, which goes on the wire as `<id>~<attempt>` with the tokens delivered so
far. Subtle rule: the wire id, the attempt number and the delivered tokens are read from
here only (`wire_id`, `attempt`, `delivered`), so a migration changes them in one place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.gateway.streams import RequestStream
from shared.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class OutputText:
    skip_special_tokens: bool = True
    include_stop_str: bool = False  # a matched stop string stays in the text
    keep_tokens: frozenset[int] = frozenset()  # special tokens shown all the same


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What one mesh request asks for: the same for every attempt."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams  # its seed is fixed before the first attempt (ModelClient)
    stop: tuple[str, ...] = ()
    output: OutputText = OutputText()
    has_fallback: bool = False  # the router has another target to try after this model
    tenant: str = ""  # the caller's (limits.tenant_of), for the scheduler's fair share
    priority: int = 0  # vLLM's `priority`: lower first


@dataclass(slots=True)
class GatewayRequest:
    spec: RequestSpec
    deadline: float  # loop time: when the request times out, whatever its attempt
    wall_deadline: float  # the same deadline in time.time(), for the scheduler
    submitted: float  # perf_counter() when its first submit began
    attempt: int = 0  # 0, then +1 on each migration
    delivered: list[int] = field(default_factory=list)  # tokens streamed to the client
    # Set when the first token arrives (or a finish without any); never on a failure.
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_scored: bool = False  # its prompt logprobs have gone to the client
    stream: RequestStream = field(init=False)  # the current attempt's: set once it is sent

    @property
    def wire_id(self) -> str:
        """The current attempt's request id on the wire."""
        request_id = self.spec.request_id
        return f"{request_id}~{self.attempt}" if self.attempt else request_id
