"""`TokenChunk.finish_reason` on the wire (schema 4): a `FinishReason` IntEnum that
round-trips as the enum; the string of schema 3 is a WireError naming the field, and a whole
frame of schema 3 is refused by its version with a message that says what to do."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from shared.protocol import SCHEMA_VERSION, FinishReason, TokenChunk, WireError, decode, encode


@pytest.mark.parametrize("reason", [None, *FinishReason])
def test_every_finish_reason_round_trips_as_the_enum(reason: FinishReason | None) -> None:
    chunk = TokenChunk("r1", 3, [7], finish_reason=reason)
    back = decode(encode(chunk), TokenChunk)
    assert back == chunk
    assert back.finish_reason is None or type(back.finish_reason) is FinishReason


def test_the_string_of_the_old_schema_is_a_wire_error_naming_the_field() -> None:
    fields = dataclasses.asdict(TokenChunk("r1", 3, [7])) | {"finish_reason": "stop"}
    with pytest.raises(WireError, match=r"TokenChunk\.finish_reason"):
        decode(msgpack.packb([SCHEMA_VERSION, "TokenChunk", fields]), TokenChunk)


def test_a_frame_of_schema_3_is_refused_saying_to_run_one_version() -> None:
    fields = dataclasses.asdict(TokenChunk("r1", 3, [7])) | {"finish_reason": "stop"}
    with pytest.raises(WireError, match=r"schema version 3: .*same splitserve version"):
        decode(msgpack.packb([3, "TokenChunk", fields]), TokenChunk)
