"""Bounds every decoded message must keep before a service acts on it.

`shared/wire_codec.py` checks a frame's shape (version, type, field names and types); this
checks the values a sender could still get wrong or forge: ids that must be NATS subject
tokens, counts that cannot be negative, token ids and block hashes in range, lists no
longer than any real request's. `decode_checked` / `decode_checked_one_of` decode and check
in one call, raising `WireError` naming the field. A KV offer or chunk that fits its
transfer badly (block ids outside the sender's cache, a shape that disagrees with the
block and layer ranges) is the decode worker's to refuse (shared/kvtransfer/chunks.py,
shared/engine/kv_handoff.py), since that refusal also ends the transfer; so is a token
id beyond the model's vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from shared.engine.lora.modules import adapter_name_error
from shared.engine.startup_phases import StartupPhase
from shared.liveness_messages import Probe, ProbeAck
from shared.lora_messages import AdapterCommand
from shared.planner_messages import MAX_REPORTED, PlannerReport
from shared.pool_messages import PoolTarget
from shared.prefix_messages import MAX_HOLDERS, PeerPrefix, PrefixPin, PrefixPinned
from shared.protocol import (
    ROLES,
    Cancel,
    DecodeTask,
    Heartbeat,
    KVChunk,
    KVDone,
    KVEvents,
    KVReady,
    PrefillTask,
    RequestFailed,
    Reserve,
    SetRole,
    SubmitRequest,
    TokenChunk,
    WorkerLost,
)
from shared.wire_codec import WireError, decode, decode_one_of

T = TypeVar("T")
MAX_ID_CHARS = 256  # request ids (the gateway's are 32 hex digits plus "~<attempt>")
MAX_TOKENS = 1 << 20  # token ids in one request: prompt + output of any model we serve
TOKEN_ID_LIMIT = 1 << 31  # token ids are below every vocabulary's int32 bound
HASH_LIMIT = 1 << 63  # block hashes are 63-bit (shared/engine/block_hash.py)
MAX_ITEMS = 1 << 20  # hashes in one KVEvents, request ids in one WorkerLost, blocks per chunk
KV_DTYPES = ("float32", "bfloat16", "float16")
MAX_POOL_WORKERS = 1 << 16  # workers of one role a PoolTarget may ask for
MAX_REASON_CHARS = 4096  # a PoolTarget's reason (for logs)
MAX_TENANT_CHARS = 64  # a tenant id (a metric label)
PRIORITY_LIMIT = 1 << 31  # |priority| below this (vLLM's is any int; ours fits an int32)
_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # as shared/subjects.py builds them


def decode_checked(data: bytes, cls: type[T]) -> T:
    message = decode(data, cls)
    check(message)
    return message


def decode_checked_one_of(data: bytes, *classes: type) -> Any:
    message = decode_one_of(data, *classes)
    check(message)
    return message


def check(message: object) -> None:
    """Raise WireError when `message` breaks a bound; messages without bounds pass."""
    checker = _CHECKS.get(type(message))
    if checker is not None:
        checker(message)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise WireError(what)


def _count(value: int, where: str, limit: int = 1 << 62) -> None:
    _require(0 <= value < limit, f"{where}: {value} out of range [0, {limit})")


def _request_id(value: str, where: str) -> None:
    _require(0 < len(value) <= MAX_ID_CHARS, f"{where}: must be 1..{MAX_ID_CHARS} characters")


def _subject_token(value: str, where: str) -> None:
    _require(bool(_SUBJECT_TOKEN.match(value)), f"{where}: {value[:40]!r} is no subject token")


def _measure(value: float, where: str) -> None:
    _require(math.isfinite(value) and value >= 0, f"{where}: {value} is no finite value >= 0")


def _role(value: str, where: str, allowed: tuple[str, ...] = ROLES) -> None:
    _require(value in allowed, f"{where}: {value[:20]!r} is none of {allowed}")


def _all_below(values: Iterable[int], limit: int, where: str) -> None:
    _require(all(0 <= v < limit for v in values), f"{where}: a value out of [0, {limit})")


def _items(values: list, where: str, limit: int = MAX_ITEMS) -> None:
    _require(len(values) <= limit, f"{where}: {len(values)} items (at most {limit})")


def _submit(m: SubmitRequest, where: str = "SubmitRequest") -> None:
    _request_id(m.request_id, f"{where}.request_id")
    _subject_token(m.gateway_id, f"{where}.gateway_id")
    _items(m.prompt_token_ids + m.delivered_token_ids, f"{where}: tokens", MAX_TOKENS)
    _all_below(m.prompt_token_ids, TOKEN_ID_LIMIT, f"{where}.prompt_token_ids")
    _all_below(m.delivered_token_ids, TOKEN_ID_LIMIT, f"{where}.delivered_token_ids")
    _require(math.isfinite(m.deadline), f"{where}.deadline: not a finite time")
    _measure(m.submitted_at, f"{where}.submitted_at")
    _count(m.attempt, f"{where}.attempt", 1 << 16)
    _adapter(m.sampling.adapter, f"{where}.sampling.adapter", empty=True)
    _require(m.tenant == "" or bool(_SUBJECT_TOKEN.match(m.tenant)), f"{where}.tenant")
    _require(len(m.tenant) <= MAX_TENANT_CHARS, f"{where}.tenant: too long")
    _require(abs(m.priority) < PRIORITY_LIMIT, f"{where}.priority: out of range")


def _adapter(name: str, where: str, empty: bool = False) -> None:
    """A LoRA adapter's name (shared/engine/lora/modules.py); "" where `empty` allows it."""
    _require((empty and not name) or adapter_name_error(name) is None, f"{where}: not a name")


def _adapter_command(m: AdapterCommand) -> None:
    _adapter(m.name, "AdapterCommand.name")
    _require(len(m.path) <= MAX_REASON_CHARS, "AdapterCommand.path: too long")
    _require(len(m.model) <= MAX_ID_CHARS, "AdapterCommand.model: too long")


def _counts_and_measures(m: Any, where: str) -> None:
    """Every int field of `m` is a count, every float a measure."""
    for field in dataclasses.fields(m):
        value = getattr(m, field.name)
        if isinstance(value, float):
            _measure(value, f"{where}.{field.name}")
        elif isinstance(value, int) and not isinstance(value, bool):
            _count(value, f"{where}.{field.name}")


def _heartbeat(m: Heartbeat) -> None:
    _subject_token(m.worker_id, "Heartbeat.worker_id")
    _require(m.role in ROLES, f"Heartbeat.role: {m.role[:20]!r} is none of {ROLES}")
    _role(m.next_role, "Heartbeat.next_role", ("", *ROLES))  # "": not changing
    _counts_and_measures(m, "Heartbeat")
    _counts_and_measures(m.kv_tier, "Heartbeat.kv_tier")
    _counts_and_measures(m.kv_peer_reads, "Heartbeat.kv_peer_reads")
    _items(m.kv_peer_reads.fallbacks, "Heartbeat.kv_peer_reads.fallbacks", 64)
    _all_below(m.kv_peer_reads.fallbacks, 1 << 62, "Heartbeat.kv_peer_reads.fallbacks")
    _require(m.free_blocks <= m.total_blocks, "Heartbeat.free_blocks: more than total_blocks")
    _require(0 < m.block_size <= 4096, "Heartbeat.block_size: out of (0, 4096]")
    _count(m.metrics_port, "Heartbeat.metrics_port", 1 << 16)
    _items(m.kv_peers, "Heartbeat.kv_peers", 4096)
    for peer in m.kv_peers:
        for value in (peer.mean_bytes, peer.mean_seconds, peer.latency):
            _measure(value, "Heartbeat.kv_peers: a measure")
    _items(m.first_tokens, "Heartbeat.first_tokens", MAX_ITEMS)
    for first in m.first_tokens:
        _request_id(first.request_id, "Heartbeat.first_tokens.request_id")
        _measure(first.ttft, "Heartbeat.first_tokens.ttft")
        _count(first.cached_tokens, "Heartbeat.first_tokens.cached_tokens", MAX_TOKENS)
    _items(m.stream_tpots, "Heartbeat.stream_tpots", MAX_ITEMS)
    for tpot in m.stream_tpots:
        _measure(tpot, "Heartbeat.stream_tpots")
    _items(m.startup, "Heartbeat.startup", len(StartupPhase))
    for phase in m.startup:
        _measure(phase.seconds, "Heartbeat.startup.seconds")


def _planner_report(m: PlannerReport) -> None:
    _subject_token(m.planner_id, "PlannerReport.planner_id")
    _count(m.seq_no, "PlannerReport.seq_no")
    _require(math.isfinite(m.time), "PlannerReport.time: not a finite time")
    _role(m.mode, "PlannerReport.mode", ("roles", "replicas"))
    for name in ("ttft_slo", "tpot_slo", "ttft_p99", "tpot_p99"):
        _measure(getattr(m, name), f"PlannerReport.{name}")
    for name in ("prefill", "decode", "both"):
        _count(getattr(m, name), f"PlannerReport.{name}", 1 << 16)
    _items(m.decisions, "PlannerReport.decisions", MAX_REPORTED)
    for decision in m.decisions:
        _require(math.isfinite(decision.time), "PlannerReport.decisions.time: not finite")
        _role(decision.role, "PlannerReport.decisions.role")


def _kv_events(m: KVEvents) -> None:
    _subject_token(m.worker_id, "KVEvents.worker_id")
    _count(m.seq_no, "KVEvents.seq_no")
    _items(m.stored + m.removed + m.tier_stored + m.tier_removed, "KVEvents: hashes")
    _all_below(m.stored, HASH_LIMIT, "KVEvents.stored")
    _all_below(m.removed, HASH_LIMIT, "KVEvents.removed")
    _all_below(m.tier_stored, HASH_LIMIT, "KVEvents.tier_stored")
    _all_below(m.tier_removed, HASH_LIMIT, "KVEvents.tier_removed")


def _prefill_task(m: PrefillTask) -> None:
    _submit(m.request, "PrefillTask.request")
    _subject_token(m.decode_worker, "PrefillTask.decode_worker")
    _count(m.skip_blocks, "PrefillTask.skip_blocks", MAX_TOKENS)
    _count(m.decode_epoch, "PrefillTask.decode_epoch")
    _peer_prefix(m.prefix_peer, "PrefillTask.prefix_peer")


def _peer_prefix(m: PeerPrefix | None, where: str) -> None:
    if m is None:
        return
    _subject_token(m.holder, f"{where}.holder")
    _count(m.holder_epoch, f"{where}.holder_epoch")
    _count(m.first_block, f"{where}.first_block", MAX_TOKENS)
    _require(0 < m.num_blocks < MAX_TOKENS, f"{where}.num_blocks: out of (0, {MAX_TOKENS})")
    _require(len(m.others) < MAX_HOLDERS, f"{where}.others: {MAX_HOLDERS} holders at most")
    for other in m.others:
        _subject_token(other.holder, f"{where}.others.holder")
        _count(other.holder_epoch, f"{where}.others.holder_epoch")
        _require(0 < other.num_blocks <= m.num_blocks, f"{where}.others.num_blocks: too many")


def _prefix_pin(m: PrefixPin) -> None:
    _request_id(m.pin_id, "PrefixPin.pin_id")
    _subject_token(m.reader, "PrefixPin.reader")
    _items(m.block_hashes, "PrefixPin.block_hashes", MAX_TOKENS)
    _all_below(m.block_hashes, HASH_LIMIT, "PrefixPin.block_hashes")
    _measure(m.hold_s, "PrefixPin.hold_s")
    _count(m.to_epoch, "PrefixPin.to_epoch")


def _prefix_pinned(m: PrefixPinned) -> None:
    _request_id(m.pin_id, "PrefixPinned.pin_id")
    _count(m.epoch, "PrefixPinned.epoch")
    _count(m.num_cache_blocks, "PrefixPinned.num_cache_blocks", MAX_ITEMS)
    _items(m.block_ids, "PrefixPinned.block_ids", MAX_TOKENS)
    _all_below(m.block_ids, HASH_LIMIT, "PrefixPinned.block_ids")
    _all_below(m.block_hashes, HASH_LIMIT, "PrefixPinned.block_hashes")
    _require(math.isfinite(m.read_by), "PrefixPinned.read_by: not a finite time")


def _decode_task(m: DecodeTask) -> None:
    _submit(m.request, "DecodeTask.request")
    _peer_prefix(m.prefix_peer, "DecodeTask.prefix_peer")


def _hashes(values: list[int | None], where: str) -> None:
    _all_below((h for h in values if h is not None), HASH_LIMIT, where)


def _kv_chunk(m: KVChunk) -> None:
    _request_id(m.request_id, "KVChunk.request_id")
    _count(m.chunk_index, "KVChunk.chunk_index", MAX_ITEMS)
    _require(0 <= m.layer_start < m.layer_end <= 4096, "KVChunk: layer range out of order")
    _count(m.first_block, "KVChunk.first_block", MAX_TOKENS)
    _epochs(m)
    _require(m.dtype in KV_DTYPES, f"KVChunk.dtype: one of {KV_DTYPES}")
    _require(len(m.shape) == 6 and all(0 < d < 1 << 20 for d in m.shape), "KVChunk.shape")
    _hashes(m.block_hashes, "KVChunk.block_hashes")


def _kv_done(m: KVDone) -> None:
    _request_id(m.request_id, "KVDone.request_id")
    _count(m.num_chunks, "KVDone.num_chunks", MAX_ITEMS)
    _epochs(m)
    _count(m.first_token_id, "KVDone.first_token_id", TOKEN_ID_LIMIT)


def _kv_ready(m: KVReady) -> None:
    _request_id(m.request_id, "KVReady.request_id")
    _count(m.num_cache_blocks, "KVReady.num_cache_blocks", MAX_ITEMS)
    _epochs(m)
    _items(m.block_ids, "KVReady.block_ids")
    _all_below(m.block_ids, HASH_LIMIT, "KVReady.block_ids")
    _hashes(m.block_hashes, "KVReady.block_hashes")
    _require(m.dtype in KV_DTYPES, f"KVReady.dtype: one of {KV_DTYPES}")
    _require(len(m.layout) == 5 and all(0 < d < 1 << 20 for d in m.layout), "KVReady.layout")
    _count(m.first_block, "KVReady.first_block", MAX_TOKENS)
    _count(m.first_token_id, "KVReady.first_token_id", TOKEN_ID_LIMIT)
    _require(math.isfinite(m.read_by), "KVReady.read_by: not a finite time")


def _epochs(m: KVChunk | KVDone | KVReady) -> None:
    _count(m.epoch, f"{type(m).__name__}.epoch")
    _count(m.to_epoch, f"{type(m).__name__}.to_epoch")


def _token_chunk(m: TokenChunk) -> None:
    _request_id(m.request_id, "TokenChunk.request_id")
    _count(m.index, "TokenChunk.index", MAX_TOKENS)
    _items(m.token_ids, "TokenChunk.token_ids", MAX_TOKENS)
    _all_below(m.token_ids, TOKEN_ID_LIMIT, "TokenChunk.token_ids")
    _require(len(m.logprobs) in (0, len(m.token_ids)), "TokenChunk.logprobs: one per token")
    _count(m.num_prompt_tokens, "TokenChunk.num_prompt_tokens", MAX_TOKENS)
    _count(m.num_cached_tokens, "TokenChunk.num_cached_tokens", MAX_TOKENS)


def _pool_target(m: PoolTarget) -> None:
    _request_id(m.publisher, "PoolTarget.publisher")
    _count(m.seq_no, "PoolTarget.seq_no")
    for role in ROLES:
        _count(m.wanted(role), f"PoolTarget.{role}", MAX_POOL_WORKERS)
    _require(len(m.reason) <= MAX_REASON_CHARS, "PoolTarget.reason: too long")


def _probe(m: Probe | ProbeAck) -> None:
    name = type(m).__name__
    _require(m.worker_id == "" or bool(_SUBJECT_TOKEN.match(m.worker_id)), f"{name}.worker_id")
    _count(m.epoch, f"{name}.epoch")


def _worker_lost(m: WorkerLost) -> None:
    _subject_token(m.worker_id, "WorkerLost.worker_id")
    _items(m.request_ids, "WorkerLost.request_ids")


_CHECKS: dict[type, Callable[[Any], None]] = {
    SubmitRequest: _submit,
    Heartbeat: _heartbeat,
    KVEvents: _kv_events,
    Reserve: lambda m: _submit(m.request, "Reserve.request"),
    PrefillTask: _prefill_task,
    DecodeTask: _decode_task,
    PrefixPin: _prefix_pin,
    PrefixPinned: _prefix_pinned,
    KVChunk: _kv_chunk,
    KVDone: _kv_done,
    KVReady: _kv_ready,
    TokenChunk: _token_chunk,
    SetRole: lambda m: _role(m.role, "SetRole.role"),
    Cancel: lambda m: _request_id(m.request_id, "Cancel.request_id"),
    WorkerLost: _worker_lost,
    RequestFailed: lambda m: _request_id(m.request_id, "RequestFailed.request_id"),
    PlannerReport: _planner_report,
    PoolTarget: _pool_target,
    AdapterCommand: _adapter_command,
    Probe: _probe,
    ProbeAck: _probe,
}
