"""`Outcome` on the wire: every answer round-trips as the enum (not a bare int), an int that
is no Outcome or a bool where an Outcome belongs is a WireError naming the field, and a
frame of the schema before `Outcome` (ok/invalid flags) is refused by its version."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from shared.protocol import (
    SCHEMA_VERSION,
    KVDone,
    Outcome,
    Reservation,
    SubmitAck,
    TaskAck,
    WireError,
    decode,
    encode,
)


def frame(message: TaskAck, **fields: object) -> bytes:
    """`message`'s frame with `fields` replaced by raw values."""
    plain = dataclasses.asdict(message) | {"outcome": int(message.outcome)} | fields
    return msgpack.packb([SCHEMA_VERSION, type(message).__name__, plain])


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_round_trips_in_every_answer(outcome: Outcome) -> None:
    messages = [
        SubmitAck("r1", outcome, "why", retry_after=1.5, decode_worker="d1"),
        Reservation("r1", outcome, num_blocks=4, num_cached_blocks=1),
        TaskAck("r1", outcome, "why"),
        KVDone("r1", 3, 42, outcome),
    ]
    for message in messages:
        back = decode(encode(message), type(message))
        assert back == message
        assert type(back.outcome) is Outcome
    assert SubmitAck("r1", outcome).accepted == (outcome == Outcome.OK)
    assert TaskAck("r1", outcome).ok == (outcome == Outcome.OK)


@pytest.mark.parametrize("bad", [5, -1, True, False, "OK", 1.0, None])
def test_a_value_that_is_no_outcome_is_a_wire_error(bad: object) -> None:
    with pytest.raises(WireError, match=r"TaskAck\.outcome"):
        decode(frame(TaskAck("r1", Outcome.OK), outcome=bad), TaskAck)


def test_a_frame_of_the_old_schema_is_refused_by_its_version() -> None:
    old = msgpack.packb([1, "TaskAck", {"request_id": "r1", "ok": True, "error": ""}])
    with pytest.raises(WireError, match="schema version 1"):
        decode(old, TaskAck)
    # Under the current version the old fields are unknown, and `outcome` is missing.
    current = msgpack.packb([SCHEMA_VERSION, "TaskAck", {"request_id": "r1", "ok": True}])
    with pytest.raises(WireError, match="unknown field"):
        decode(current, TaskAck)
