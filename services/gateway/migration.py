"""Migration: a request whose attempt failed after acceptance goes on as attempt + 1.

When an attempt fails (an error chunk, `WorkerLost`, an abort, or no token for the stall
timeout), the gateway cancels it and resubmits the prompt plus the tokens delivered so far
as the next attempt of the same `GatewayRequest` (wire id `<id>~<attempt>`), at most
`migration_limit` times, retrying refusals until the stall timeout or the deadline. The
seed was fixed before the first submit, so a migrated sampled request draws the same
tokens (the draw at each position depends only on seed and position).
Subtle rule: the failed attempt is closed and cancelled before the next one is sent, so no
late chunk of it reaches the new attempt's stream.
"""

from __future__ import annotations

import asyncio
import logging

from services.gateway.gateway_request import GatewayRequest
from services.gateway.model_client import ModelClient, retrying
from services.gateway.refusals import Failure, GenerationFailed, Refused

log = logging.getLogger(__name__)


async def migrate(
    client: ModelClient, job: GatewayRequest, why: str, failure: Failure = Failure.LOST
) -> None:
    """Cancel the failed attempt and submit the next; GenerationFailed (`failure`) when the
    migration limit is reached, or UNPLACED when no worker takes it in time."""
    client.streams.close_stream(job.wire_id)
    await client.cancel(job.wire_id)  # frees whatever the failed attempt still holds
    if job.attempt >= client.config.migration_limit:
        tries = f" (after {job.attempt} migrations)" if job.attempt else ""
        raise GenerationFailed(why + tries, failure)
    job.attempt += 1
    log.warning(
        "%s: %s; migrating with %d delivered tokens (attempt %d)",
        job.spec.request_id,
        why,
        len(job.delivered),
        job.attempt,
    )
    client.metrics.migrations.inc()
    loop = asyncio.get_running_loop()
    give_up = min(job.deadline, loop.time() + client.config.stall_timeout)
    try:
        job.stream = await retrying(lambda: client.send(job), give_up)
    except Refused as exc:
        raise GenerationFailed(f"{why}; migration refused: {exc}", Failure.UNPLACED) from None
