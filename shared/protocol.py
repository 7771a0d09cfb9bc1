"""Every message that crosses a process boundary: one dataclass each (DESIGN.md section 3);
the KV hand-off's live in shared/kv_messages.py and `Outcome` in shared/outcome.py, both
re-exported here.

Encode with `encode(msg)`, decode with `decode(data, Cls)` (strict: see shared/wire_codec.py).
Times are Unix seconds (float). The W3C `traceparent` travels in NATS headers, not here.
No torch here: the gateway and the scheduler import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import FinishReason
from shared.kv_messages import KVChunk, KVDone, KVReady
from shared.kv_tier_messages import TierCounters
from shared.outcome import Outcome
from shared.planner_messages import PlannerReport
from shared.prefix_messages import PeerPrefix, PeerReadCounters
from shared.sleep_level import SleepLevel
from shared.startup_messages import PhaseTime
from shared.wire_codec import SCHEMA_VERSION, WireError, decode, decode_one_of, encode

__all__ = [
    "SCHEMA_VERSION",
    "FinishReason",
    "KVChunk",
    "KVDone",
    "KVReady",
    "Outcome",
    "WireError",
    "decode",
    "decode_one_of",
    "encode",
]

ROLES = ("prefill", "decode", "both")


# -- gateway ⇄ scheduler ------------------------------------------------------------------
@dataclass(slots=True)
class SubmitRequest:
    request_id: str
    gateway_id: str  # tokens go to <ns>.gateway.<gateway_id>.tokens
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline: float  # absolute; every stage gives up after it
    attempt: int = 0  # 0 first time; +1 on each migration
    delivered_token_ids: list[int] = field(default_factory=list)  # already streamed (migration)
    model: str = ""  # the served model's name: only its workers take it; "": any worker
    # The gateway has a fallback for this model: with no worker of the model registered,
    # refuse at once (UNAVAILABLE) rather than wait for one to join.
    has_fallback: bool = False
    # When the gateway sent this attempt (Unix seconds; 0: unknown): the worker that streams
    # its first token reports the observed TTFT from it (path choice, issue 57).
    submitted_at: float = 0.0
    # Fair service (services/scheduler/fair_share.py): the caller's tenant, an id the gateway
    # derives from its API key (never the key; "": no keys), and vLLM's `priority` (lower first).
    tenant: str = ""
    priority: int = 0
    # The previous attempt's split, so the scheduler replica that places this one judges
    # its hand-off (services/scheduler/hand_offs.py): its prefill and decode workers ("":
    # it was not split, or this is attempt 0) and the tokens delivered before it.
    last_prefill: str = ""
    last_decode: str = ""
    last_delivered: int = 0


@dataclass(slots=True)
class SubmitAck:
    request_id: str
    outcome: Outcome
    error: str = ""
    retry_after: float = 0.0  # seconds, when refused for load
    prefill_worker: str = ""  # "" when the decode worker prefills itself
    decode_worker: str = ""
    predicted_ttft: float = 0.0  # seconds, the scheduler's prediction for the path it chose

    @property
    def accepted(self) -> bool:
        return self.outcome == Outcome.OK


# -- workers → scheduler ------------------------------------------------------------------
@dataclass(slots=True)
class KVPeer:
    """KV a prefill worker has sent one decode worker, since start."""

    worker_id: str  # the decode worker
    transport: str  # the one used last: "nixl" | "nats"
    blocks: int
    transfers: int
    # Measured link (path choice): EWMAs per transfer of its bytes and seconds (their ratio
    # is the bandwidth), and of the seconds of small transfers (the fixed cost; 0: none yet).
    mean_bytes: float = 0.0
    mean_seconds: float = 0.0
    latency: float = 0.0


@dataclass(slots=True)
class FirstToken:
    """A request's first token streamed by a worker: TTFT observed from its `submitted_at`."""

    request_id: str
    ttft: float  # seconds
    cached_tokens: int = 0  # prompt tokens its engine found cached (pool or second tier)


@dataclass(slots=True)
class Heartbeat:
    worker_id: str
    role: str  # one of ROLES
    model: str
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    block_size: int
    draining: bool = False
    metrics_port: int = 0
    num_requests: int = 0  # requests the worker holds in any state (0: nothing left behind)
    kv_blocks_sent: int = 0  # since start: blocks shipped to decode workers (prefill side)
    kv_blocks_received: int = 0  # since start: blocks written from prefill workers (decode side)
    prefix_queries: int = 0  # since start: prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # since start: of those, tokens served from it
    spec_proposed_tokens: int = 0  # since start: draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # since start: of those, accepted
    spec_verify_steps: int = 0  # since start: verify chunks computed
    kv_transports: list[str] = field(default_factory=list)  # it can move KV by, best first
    kv_peers: list[KVPeer] = field(default_factory=list)  # prefill side: where KV went
    engine: str = "native"  # the engine it runs: "native" | "vllm" (never mixed per model)
    # Measured costs (the scheduler's path choice, services/scheduler/path_cost.py); 0 is
    # "not measured yet". EWMAs over the engine's steps (services/worker/step_costs.py).
    prefill_rate: float = 0.0  # prompt tokens computed per second of step time
    decode_step_s: float = 0.0  # seconds per step with no prompt in it
    decode_batch: float = 0.0  # running rows those steps had
    decode_row_s: float = 0.0  # seconds one more row adds to those steps (0: not fitted yet)
    queued_prompt_tokens: int = 0  # prompt tokens admitted, not computed yet
    busy: float = 0.0  # share of the time since the last beat spent in steps, 0..1
    block_bytes: int = 0  # one KV block, every layer: what a transfer moves per block
    first_tokens: list[FirstToken] = field(default_factory=list)  # streamed since last beat
    # Mid-change (SetRole): the role it is changing to, "" when not changing; `role` is the
    # one it serves until the change is over, and no new work is placed on it meanwhile.
    next_role: str = ""
    # Time per output token after the first (seconds) of each stream that finished here since
    # the last beat, as its client saw them: the planner's TPOT (services/planner/window.py).
    stream_tpots: list[float] = field(default_factory=list)
    stall_s: float = 0.0  # recent seconds its streams waited on prompt work (step_costs.py)
    stream_tokens: int = 0  # the fewest max_tokens among its running streams (0: none)
    # LoRA (shared/lora_messages.py): adapters it serves, those in its slots now (the
    # scheduler's affinity), and slots it has filled since start
    adapters: list[str] = field(default_factory=list)
    adapters_loaded: list[str] = field(default_factory=list)
    adapter_swap_ins: int = 0
    kv_tier: TierCounters = field(default_factory=TierCounters)  # its second KV tier
    kv_peer_reads: PeerReadCounters = field(default_factory=PeerReadCounters)  # from peers
    epoch: int = 0  # the worker process's (shared/epoch.py); 0: an old worker, not said
    startup: list[PhaseTime] = field(default_factory=list)  # its start, phase by phase
    ready_s: float = 0.0  # its process's start → serving, seconds
    sleep_level: SleepLevel = SleepLevel.AWAKE  # asleep: never placed on (sleep_messages.py)
    num_preemptions: int = 0  # since start: running sequences sent back to recompute


@dataclass(slots=True)
class KVEvents:
    worker_id: str
    seq_no: int  # per worker, +1 each message; a gap means the scheduler missed some
    stored: list[int] = field(default_factory=list)  # block hashes now in its prefix cache
    removed: list[int] = field(default_factory=list)  # block hashes evicted
    tier_stored: list[int] = field(default_factory=list)  # now in its second KV tier
    tier_removed: list[int] = field(default_factory=list)  # no longer in it


# -- scheduler → workers ------------------------------------------------------------------
@dataclass(slots=True)
class Reserve:
    """Hold decode blocks for request.prompt_token_ids + request.delivered_token_ids (all that
    needs KV); the decode worker keeps the request (sampling, gateway, deadline) with them.
    The reservation is dropped if no KVDone arrives by the request's deadline."""

    request: SubmitRequest

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class Reservation:
    request_id: str
    outcome: Outcome
    num_blocks: int = 0
    num_cached_blocks: int = 0  # leading blocks decode already holds: not to be sent
    error: str = ""
    transports: list[str] = field(default_factory=list)  # it can receive KV by, best first
    epoch: int = 0  # the reserving process's (shared/epoch.py): its KV goes to that one only

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK


@dataclass(slots=True)
class PrefillTask:
    request: SubmitRequest
    decode_worker: str  # where the KV goes
    skip_blocks: int  # = the reservation's num_cached_blocks
    transports: list[str] = field(default_factory=list)  # = the reservation's; [] = nats
    decode_epoch: int = 0  # = the reservation's epoch: the decode process the KV is for
    prefix_peer: PeerPrefix | None = None  # a worker holding more of the prefix (read it)


@dataclass(slots=True)
class DecodeTask:
    """Decode-only path (conditional disaggregation): the decode worker prefills itself."""

    request: SubmitRequest
    prefix_peer: PeerPrefix | None = None  # as PrefillTask's


@dataclass(slots=True)
class SetRole:
    """Serve `role` from now on (DESIGN.md section 9), to `<ns>.worker.<id>.role`; answered
    with a `TaskAck`: OK once the change has started (its end shows in the heartbeats),
    UNAVAILABLE while draining or changing already. The worker finishes what it holds for
    the roles it drops; `hurry`: it fails their running streams at once, and their gateways
    migrate them."""

    role: str  # one of ROLES
    hurry: bool = False


@dataclass(slots=True)
class TaskAck:
    request_id: str
    outcome: Outcome
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK


# -- workers → gateway --------------------------------------------------------------------
@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class PromptTokenLogprob:
    """A prompt token scored (SamplingParams.prompt_logprobs)."""

    token_id: int
    logprob: float
    rank: int  # 1: the most likely token at its position
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class TokenChunk:
    request_id: str
    index: int  # position in the output of token_ids[0]; lets the gateway drop duplicates
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # on the last chunk; ABORT goes with `error`
    error: str = ""  # a failure the gateway reports to the client
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # with the first token, when asked: prompt tokens 1.. (the first has no logprob)
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)


# -- anyone → all -------------------------------------------------------------------------
@dataclass(slots=True)
class Cancel:
    request_id: str
    reason: str = ""


@dataclass(slots=True)
class WorkerLost:
    worker_id: str
    request_ids: list[str]


@dataclass(slots=True)
class RequestFailed:
    request_id: str
    error: str
    retryable: bool = False


# -- status -------------------------------------------------------------------------------
@dataclass(slots=True)
class StatusQuery:
    pass


@dataclass(slots=True)
class WorkerStatus:
    heartbeat: Heartbeat
    last_seen: float
    assigned: list[str] = field(default_factory=list)  # request ids placed on it


@dataclass(slots=True)
class MeshStatus:
    workers: list[WorkerStatus]
    queue_length: int
    admitted: int
    rejected: int
    planner: PlannerReport | None = None  # the planner's latest report (None: no planner)
