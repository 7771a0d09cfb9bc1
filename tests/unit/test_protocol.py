"""Wire compatibility of `Heartbeat`: fields added later decode as their defaults when an
older worker leaves them out, and round-trip when present; `SetRole` and a heartbeat's
`next_role` name a role or nothing."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from shared.protocol import SCHEMA_VERSION, Heartbeat, SetRole, WireError, decode, encode
from shared.wire_checks import decode_checked


def test_heartbeat_without_spec_decode_fields_still_decodes() -> None:
    beat = Heartbeat("d0", "decode", "tiny", 2, 1, 30, 64, 16, spec_proposed_tokens=40,
                     spec_accepted_tokens=31, spec_verify_steps=10)  # fmt: skip
    assert decode(encode(beat), Heartbeat) == beat
    fields = dataclasses.asdict(beat)
    for name in ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verify_steps"):
        del fields[name]
    old = msgpack.packb([SCHEMA_VERSION, "Heartbeat", fields], use_bin_type=True)
    assert decode(old, Heartbeat) == dataclasses.replace(
        beat, spec_proposed_tokens=0, spec_accepted_tokens=0, spec_verify_steps=0
    )
    fields["spec_accepted_tokens"] = "many"
    with pytest.raises(WireError, match="spec_accepted_tokens"):
        decode(msgpack.packb([SCHEMA_VERSION, "Heartbeat", fields]), Heartbeat)


def test_set_role_and_next_role_round_trip_and_name_a_role() -> None:
    hurried = SetRole("prefill", hurry=True)
    assert decode_checked(encode(hurried), SetRole) == hurried
    assert decode_checked(encode(SetRole("both")), SetRole).hurry is False
    with pytest.raises(WireError, match=r"SetRole\.role"):
        decode_checked(encode(SetRole("router")), SetRole)
    beat = Heartbeat("d0", "decode", "tiny", 0, 0, 30, 64, 16, next_role="prefill")
    assert decode_checked(encode(beat), Heartbeat) == beat
    fields = dataclasses.asdict(beat)
    del fields["next_role"]  # a worker from before role changes
    old = msgpack.packb([SCHEMA_VERSION, "Heartbeat", fields], use_bin_type=True)
    assert decode(old, Heartbeat).next_role == ""
    with pytest.raises(WireError, match="next_role"):
        decode_checked(encode(dataclasses.replace(beat, next_role="gateway")), Heartbeat)
