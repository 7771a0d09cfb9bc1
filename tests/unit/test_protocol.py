"""Wire compatibility of `Heartbeat`: fields added later decode as their defaults when an
older worker leaves them out, and round-trip when present; the path choice's fields
(measures, first tokens, `submitted_at`, `predicted_ttft`) too, and measures that are not
finite and >= 0 are refused; `SetRole` and a heartbeat's `next_role` name a role or nothing."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from shared.engine.sampling_params import SamplingParams
from shared.protocol import (
    SCHEMA_VERSION,
    FirstToken,
    Heartbeat,
    KVPeer,
    Outcome,
    SetRole,
    SubmitAck,
    SubmitRequest,
    WireError,
    decode,
    encode,
)
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


def test_path_choice_fields_round_trip_and_default_when_left_out() -> None:
    peer = KVPeer("d1", "nixl", 64, 4, mean_bytes=3.9e7, mean_seconds=0.02, latency=0.003)
    beat = Heartbeat("p0", "prefill", "tiny", 1, 2, 30, 64, 16, kv_peers=[peer],
                     prefill_rate=2600.5, decode_step_s=0.015, decode_batch=3.5,
                     queued_prompt_tokens=900, busy=0.75, block_bytes=614400,
                     first_tokens=[FirstToken("r1", 0.4)])  # fmt: skip
    assert decode(encode(beat), Heartbeat) == beat
    request = SubmitRequest("r1", "g1", [1, 2], SamplingParams(), 1e10, submitted_at=1.7e9)
    assert decode(encode(request), SubmitRequest) == request
    ack = SubmitAck("r1", Outcome.OK, decode_worker="d1", predicted_ttft=0.37)
    assert decode(encode(ack), SubmitAck) == ack
    fields = dataclasses.asdict(beat)
    new = ("prefill_rate", "decode_step_s", "decode_batch", "queued_prompt_tokens", "busy",
           "block_bytes", "first_tokens")  # fmt: skip
    for name in new:
        del fields[name]
    for name in ("mean_bytes", "mean_seconds", "latency"):
        del fields["kv_peers"][0][name]
    old = msgpack.packb([SCHEMA_VERSION, "Heartbeat", fields], use_bin_type=True)
    assert decode(old, Heartbeat) == dataclasses.replace(
        beat,
        kv_peers=[KVPeer("d1", "nixl", 64, 4)],
        **{name: type(getattr(beat, name))() for name in new},
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prefill_rate": float("nan")}, "prefill_rate"),
        ({"busy": -0.5}, "busy"),
        ({"first_tokens": [FirstToken("r1", float("inf"))]}, "first_tokens.ttft"),
        ({"first_tokens": [FirstToken("", 0.1)]}, "first_tokens.request_id"),
        ({"kv_peers": [KVPeer("d1", "nixl", 1, 1, latency=-1.0)]}, "kv_peers"),
    ],
)
def test_measures_out_of_range_are_refused(change: dict, field: str) -> None:
    beat = dataclasses.replace(Heartbeat("p0", "prefill", "tiny", 0, 0, 1, 1, 16), **change)
    with pytest.raises(WireError, match=field):
        decode_checked(encode(beat), Heartbeat)
    request = SubmitRequest("r1", "g1", [1], SamplingParams(), 1e10, submitted_at=float("nan"))
    with pytest.raises(WireError, match="submitted_at"):
        decode_checked(encode(request), SubmitRequest)


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
