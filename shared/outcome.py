"""How a worker, or the scheduler, answered a request for work: one IntEnum every answer
message carries (shared/protocol.py re-exports it with the messages).

The one subtle rule: values are on the wire, so a member is only ever appended.
"""

from __future__ import annotations

from enum import IntEnum


class Outcome(IntEnum):
    """How a worker, or the scheduler, answered a request for work (acks, reservations,
    KV transfers). Every refusal names its reason in the message's `error`."""

    OK = 0
    BUSY = 1  # no room right now (KV blocks, queue): ask again later, or elsewhere
    UNAVAILABLE = 2  # this one takes no such work (draining, no such worker or role)
    INVALID = 3  # the request itself is bad (the engine's reason): nobody will take it
    FAILED = 4  # an internal error or a lost peer: try another worker
