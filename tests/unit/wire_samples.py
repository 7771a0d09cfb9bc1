"""The wire fuzz test's material (tests/unit/test_wire_fuzz.py): one valid sample of every
message kind, the out-of-range values each field must refuse (`BOUNDS`), and `bad_frames`,
the hypothesis strategy that draws a frame no receiver of a kind may accept.

The one subtle rule: a frame is "bad" only by what the sample says of its field; a field the
sample leaves None says nothing of the type it takes, so it is never given a misfit.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgpack
from hypothesis import strategies as st

from shared.engine.sampling_params import SamplingParams
from shared.engine.startup_phases import StartupPhase
from shared.liveness_messages import Probe, ProbeAck
from shared.lora_messages import AdapterAction, AdapterAnswer, AdapterCommand, AdapterReport
from shared.planner_messages import PlannerReport, ReportedDecision
from shared.pool_messages import PoolTarget
from shared.prefix_messages import PeerHolder, PeerPrefix, PinOp, PrefixPin, PrefixPinned
from shared.protocol import (
    Cancel,
    DecodeTask,
    Heartbeat,
    KVChunk,
    KVDone,
    KVEvents,
    KVReady,
    Outcome,
    PrefillTask,
    RequestFailed,
    Reserve,
    SetRole,
    StatusQuery,
    SubmitRequest,
    TokenChunk,
    WorkerLost,
    encode,
)
from shared.sleep_level import SleepLevel
from shared.sleep_messages import SleepCommand, SleepReply
from shared.startup_messages import PhaseTime
from shared.wire_codec import SCHEMA_VERSION

DECIDED = ReportedDecision(1.0, "add", "ttft_over_slo", "prefill")
SUBMIT = SubmitRequest("r1", "g1", [1, 2, 3], SamplingParams(), deadline=time.time() + 600)
SAMPLES: list[Any] = [
    SUBMIT,
    StatusQuery(),
    Heartbeat(
        "w1", "decode", "m", 0, 0, 10, 10, 16, startup=[PhaseTime(StartupPhase.IMPORTS, 1.5)]
    ),
    KVEvents("w0", 1, [1], []),
    Reserve(SUBMIT),
    PrefillTask(SUBMIT, "w2", 0, prefix_peer=PeerPrefix("w3", 7, 0, 2)),
    DecodeTask(SUBMIT, PeerPrefix("w3", 7, 1, 4, [PeerHolder("w4", 2, 3)])),
    PrefixPin("r1", "w2", PinOp.PIN, [11, 12], 1.0, 7),
    PrefixPinned("r1", Outcome.OK, "", "w3", 7, "nixl", b"m", 10, [1, 16, 2, 1, 4], "float32"),
    SetRole("prefill"),
    KVChunk("r1", 0, 0, 1, 0, [None], "float32", [1, 1, 16, 2, 1, 4], bytes(512)),
    KVDone("r1", 1, 5),
    KVReady("r1", "nixl", "a", b"m", 10, [1, 16, 2, 1, 4], "float32", 0, [1], [None], 5, 1e10),
    TokenChunk("r1", 0, [5]),
    Cancel("r1"),
    WorkerLost("w1", ["r1"]),
    RequestFailed("r1", "x"),
    PlannerReport("planner", 1, 1.0, "replicas", "", 1.0, 0.04, 1, 1, 0, decisions=[DECIDED]),
    PoolTarget("planner-0", 3, "", 1, 2, 0, "queue"),
    AdapterCommand(AdapterAction.LOAD, "sql-lora", "/adapters/sql", "m"),
    AdapterAnswer("w1", Outcome.OK),
    AdapterReport([AdapterAnswer("w1", Outcome.OK)]),
    Probe("w1", 7),
    ProbeAck("w1", 7),
    SleepCommand(SleepLevel.KV_FREED, 5.0),
    SleepReply("w1", SleepLevel.AWAKE),
]
SAMPLE = {type(m): m for m in SAMPLES}
# Values out of range per message: (path of the field, a bad value). Paths go into nested
# dataclasses with dots.
NEGATIVE = st.integers(-(2**63), -1)
HUGE = st.integers(min_value=2**63, max_value=2**64 - 1)
BAD_ID = st.sampled_from(["", "a.b", "x y", "*", ">", "é", "x" * 300])
REQUEST_BOUNDS = {
    "request_id": st.just(""),
    "gateway_id": BAD_ID,
    "prompt_token_ids": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
    "delivered_token_ids": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
    "attempt": NEGATIVE,
    "deadline": st.sampled_from([float("nan"), float("inf")]),
    "submitted_at": st.sampled_from([float("nan"), float("-inf"), -1.0]),
    "sampling.temperature": st.floats(max_value=-0.01),
    "sampling.top_p": st.floats(min_value=1.01, max_value=1e9),
    "sampling.adapter": st.sampled_from([" ", "a b", "x" * 300, "a\x00b"]),
    "tenant": BAD_ID.filter(bool),
    "priority": st.integers(2**31, 2**62) | st.integers(-(2**62), -(2**31)),
}
PEER_BOUNDS = {
    "prefix_peer.holder": BAD_ID,
    "prefix_peer.holder_epoch": NEGATIVE,
    "prefix_peer.first_block": NEGATIVE | HUGE,
    "prefix_peer.num_blocks": st.integers(-(2**62), 0),
    "prefix_peer.others": st.sampled_from(
        [
            [{"holder": "", "holder_epoch": 0, "num_blocks": 1}],
            [{"holder": "w4", "holder_epoch": -1, "num_blocks": 1}],
            [{"holder": "w4", "holder_epoch": 0, "num_blocks": 99}],  # more than the hint's
            [{"holder": "w4", "holder_epoch": 0, "num_blocks": 1}] * 3,  # too many holders
        ]
    ),
}
DECISION = {"time": 1.0, "action": "add", "reason": "kv_full", "role": "decode"}
DECISION |= {"worker_id": "", "detail": "", "outcome": ""}
BOUNDS: dict[type, dict[str, st.SearchStrategy]] = {
    SubmitRequest: REQUEST_BOUNDS,
    Heartbeat: {
        "worker_id": BAD_ID,
        "role": st.sampled_from(["", "gateway", "prefil"]),
        "num_running": NEGATIVE | HUGE,
        "free_blocks": st.integers(11, 2**40),  # > total_blocks
        "block_size": st.integers(-(2**63), 0) | st.integers(4097, 2**62),
        "metrics_port": st.integers(65536, 2**62) | NEGATIVE,
        "kv_blocks_sent": NEGATIVE,
        "num_preemptions": NEGATIVE,
        "prefill_rate": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "busy": st.floats(max_value=-1e-9),
        "ready_s": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "next_role": st.sampled_from(["gateway", "prefil", "BOTH"]),
        "kv_tier.hits": NEGATIVE,
        "kv_peer_reads.blocks": NEGATIVE,
        "kv_peer_reads.seconds": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "kv_tier.load_seconds": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "stream_tpots": st.lists(
            st.sampled_from([float("nan"), float("inf"), -1.0]), min_size=1, max_size=3
        ),
    },
    KVEvents: {
        "worker_id": BAD_ID,
        "seq_no": NEGATIVE | HUGE,
        "stored": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "removed": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "tier_stored": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
    },
    Reserve: {f"request.{k}": v for k, v in REQUEST_BOUNDS.items()},
    PrefillTask: {
        **{f"request.{k}": v for k, v in REQUEST_BOUNDS.items()},
        "decode_worker": BAD_ID,
        "skip_blocks": NEGATIVE,
        "decode_epoch": NEGATIVE | HUGE,
        **PEER_BOUNDS,
    },
    DecodeTask: {**{f"request.{k}": v for k, v in REQUEST_BOUNDS.items()}, **PEER_BOUNDS},
    PrefixPin: {
        "pin_id": st.sampled_from(["", "x" * 300]),
        "reader": BAD_ID,
        "block_hashes": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "hold_s": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "to_epoch": NEGATIVE,
    },
    SetRole: {"role": st.sampled_from(["", "gateway", "prefil", "Decode", "x" * 300])},
    KVChunk: {
        "request_id": st.just(""),
        "chunk_index": NEGATIVE,
        "layer_start": st.integers(1, 2**62) | NEGATIVE,  # >= layer_end, or < 0
        "first_block": NEGATIVE,
        "dtype": st.sampled_from(["int8", "float64", ""]),
        "shape": st.lists(st.integers(-(2**62), 0), min_size=6, max_size=6)
        | st.lists(st.integers(1, 4), max_size=5),
        "block_hashes": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
    },
    KVDone: {"request_id": st.just(""), "num_chunks": NEGATIVE, "first_token_id": NEGATIVE | HUGE},
    KVReady: {
        "num_cache_blocks": NEGATIVE,
        "block_ids": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "block_hashes": st.lists(NEGATIVE | HUGE, min_size=1, max_size=1),
        "layout": st.lists(st.integers(1, 4), max_size=4),
        "first_token_id": NEGATIVE,
        "read_by": st.just(float("nan")),
        "epoch": NEGATIVE,
        "to_epoch": HUGE,
    },
    TokenChunk: {
        "request_id": st.just("x" * 300),
        "index": NEGATIVE | HUGE,
        "token_ids": st.lists(NEGATIVE | HUGE, min_size=1, max_size=3),
        "num_prompt_tokens": NEGATIVE,
    },
    Cancel: {"request_id": st.just("")},
    WorkerLost: {"worker_id": BAD_ID},
    RequestFailed: {"request_id": st.just("")},
    PlannerReport: {
        "planner_id": BAD_ID,
        "seq_no": NEGATIVE | HUGE,
        "mode": st.sampled_from(["", "auto", "Roles"]),
        "time": st.sampled_from([float("nan"), float("inf")]),
        "ttft_slo": st.sampled_from([float("nan"), float("inf"), -1.0]),
        "decode": NEGATIVE | st.integers(1 << 16, 2**62),
        "decisions": st.lists(st.just(DECISION), min_size=21, max_size=22),  # > MAX_REPORTED
    },
    AdapterCommand: {
        "name": st.sampled_from(["", "a b", "x" * 300, ".x"]),
        "path": st.just("x" * 5000),
        "model": st.just("x" * 300),
    },
    Probe: {"worker_id": st.sampled_from(["a.b", "x y", "*", "x" * 300]), "epoch": NEGATIVE},
    PoolTarget: {
        "publisher": st.sampled_from(["", "x" * 300]),
        "seq_no": NEGATIVE | HUGE,
        "prefill": NEGATIVE | st.integers(1 << 16, 2**62),
        "decode": NEGATIVE,
        "both": NEGATIVE,
        "reason": st.just("x" * 5000),
    },
}
PACKABLE_INT = st.integers(-(2**63), 2**64 - 1)  # what msgpack can hold
PLAIN = st.none() | st.booleans() | PACKABLE_INT | st.floats() | st.text() | st.binary()
MSGPACK_VALUES = st.recursive(
    PLAIN,
    lambda inner: st.lists(inner) | st.dictionaries(st.text() | PACKABLE_INT, inner),
    max_leaves=12,
)


def plain(message: Any) -> list:
    """The frame of `message` as msgpack values: [version, type, fields]."""
    return msgpack.unpackb(encode(message), raw=False, strict_map_key=False)


def with_value(fields: dict, path: str, value: Any) -> dict:
    head, _, rest = path.partition(".")
    if rest:
        return fields | {head: with_value(fields[head], rest, value)}
    return fields | {head: value}


@st.composite
def bad_frames(draw: st.DrawFn, kinds: tuple[type, ...]) -> bytes:
    """One frame no receiver of `kinds` may accept."""
    kind = draw(st.sampled_from(kinds))
    version, name, fields = plain(SAMPLE[kind])
    others = [m for m in SAMPLES if type(m) not in kinds]
    how = draw(st.sampled_from(["bytes", "msgpack", "kind", "version", "shape", "range"]))
    if how == "bytes":
        return draw(st.binary(max_size=200))
    if how == "msgpack":
        return msgpack.packb(draw(MSGPACK_VALUES), use_bin_type=True)
    if how == "kind":
        return encode(draw(st.sampled_from(others)))
    if how == "version":
        old = draw(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != SCHEMA_VERSION))
        return msgpack.packb([old, name, fields], use_bin_type=True)
    if how == "shape":
        shape = draw(st.sampled_from(["missing", "extra", "type", "frame"]))
        required = sorted(f.name for f in dataclasses.fields(kind) if _required(f))
        if shape == "frame" or not fields:
            return msgpack.packb(draw(st.lists(PLAIN, max_size=5)), use_bin_type=True)
        if shape == "missing" and required:
            gone = draw(st.sampled_from(required))
            fields = {k: v for k, v in fields.items() if k != gone}
        elif shape == "type":
            # a field the sample leaves None says nothing of the type it takes
            field = draw(st.sampled_from(sorted(k for k, v in fields.items() if v is not None)))
            fields = fields | {field: draw(PLAIN.filter(lambda v: _misfits(v, fields[field])))}
        else:
            fields = fields | {"zz_unknown": 1}
        return msgpack.packb([version, name, fields], use_bin_type=True)
    bounds = BOUNDS.get(kind, {})
    if not bounds:
        return encode(draw(st.sampled_from(others)))
    path = draw(st.sampled_from(sorted(bounds)))
    return msgpack.packb([version, name, with_value(fields, path, draw(bounds[path]))])


def _misfits(value: Any, original: Any) -> bool:
    """Is `value` of another type than a field holding `original` takes? (None fits the
    optional fields, an int fits a float field.)"""
    numbers = (int, float)
    if value is None or (isinstance(value, numbers) and isinstance(original, numbers)):
        return isinstance(value, bool) != isinstance(original, bool) and value is not None
    return type(value) is not type(original)


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
