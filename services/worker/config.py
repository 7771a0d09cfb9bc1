"""`WorkerConfig`: every setting of one worker process, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.protocol import ROLES

if TYPE_CHECKING:  # the engine (and torch) load when the worker starts, not at flag parsing
    from shared.engine.engine_config import EngineConfig


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    worker_id: str
    role: str  # one of ROLES
    model_dir: Path
    model_name: str  # what heartbeats report
    nats_url: str = "nats://127.0.0.1:4222"
    namespace: str = "ss"
    num_threads: int = 1  # torch intra-op threads
    kv_cache_gib: float = 2.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gib when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    device: str = "auto"  # auto (cuda when visible, else cpu) | cpu | cuda | cuda:N
    dtype: str = "float32"  # weights and KV: float32 | bfloat16 (the one for GPUs) | float16
    attention_backend: str = "auto"  # auto | torch | cpu | triton (see EngineConfig)
    batch_invariant: bool | None = None  # None: on with the C++ kernels and float weights
    heartbeat_interval: float = 1.0  # seconds between heartbeats (and KV event checks)
    transfer_timeout: float = 30.0  # seconds one KV transfer may take at most
    # A decode reservation waits this long for its first KV chunk (the prefill may queue),
    # then `transfer_timeout` after each chunk; past that its blocks are freed.
    reservation_timeout: float = 120.0
    kv_window: int = 4  # KV chunks in flight, unacknowledged
    kv_headroom: int = 64 * 1024  # bytes left under max_payload for a chunk's other fields
    grace_period: float = 30.0  # seconds in-flight work may take after SIGTERM
    otlp_endpoint: str = ""  # traces over OTLP/HTTP; "": off
    metrics_port: int | None = None  # Prometheus /metrics; 0: a free port; None: not served
    quantization: str | None = None  # None | int8 | int4 (weight-only, applied at load)
    speculative: str | None = None  # None | ngram | draft (used by the decoding side only)
    num_speculative_tokens: int = 4
    draft_model_dir: Path | None = None  # speculative="draft": same vocabulary as the model

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.num_threads < 1 or self.kv_window < 1:
            raise ValueError("num_threads and kv_window must be positive")
        if min(self.heartbeat_interval, self.transfer_timeout, self.reservation_timeout) <= 0:
            raise ValueError(
                "heartbeat_interval, transfer_timeout and reservation_timeout must be positive"
            )
        if (self.speculative == "draft") != (self.draft_model_dir is not None):
            raise ValueError("--speculative draft needs --draft-model, and only it takes one")

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    def engine_config(self) -> EngineConfig:
        from shared.engine.engine_config import EngineConfig

        return EngineConfig(
            model_dir=self.model_dir,
            kv_cache_gib=self.kv_cache_gib,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            device=self.device,
            dtype=self.dtype,
            attention_backend=self.attention_backend,
            batch_invariant=self.batch_invariant,
            model_id=self.model_name,
            num_threads=self.num_threads,
            quantization=self.quantization,
            speculative=self.speculative if self.decodes else None,
            num_speculative_tokens=self.num_speculative_tokens,
            draft_model_dir=self.draft_model_dir if self.decodes else None,
        )
