"""Wire compatibility of `Heartbeat`: fields added later decode as their defaults when an
older worker leaves them out, and round-trip when present."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from shared.protocol import SCHEMA_VERSION, Heartbeat, WireError, decode, encode


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
