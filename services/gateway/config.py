"""GatewayConfig: the gateway's settings, frozen, filled from CLI flags and SPLITSERVE_* env."""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from shared.config import CommonConfig


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    common: CommonConfig
    model_dir: Path  # tokenizer.json, tokenizer_config.json (chat template), config.json
    served_model_name: str
    gateway_id: str  # tokens come back on <ns>.gateway.<gateway_id>.tokens
    max_model_len: int  # prompt tokens + max_tokens may not exceed it
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    request_timeout: float = 600.0  # seconds from arrival to the last token
    stall_timeout: float = 60.0  # seconds without a token before the request is failed
    # Seconds to wait for the scheduler's SubmitAck: longer than a placement that tries a
    # worker or two (the scheduler's --reserve-timeout each), bounded by the request deadline.
    submit_timeout: float = 30.0
    max_pending: int = 256  # requests in flight on this gateway; more are refused with 429
    migration_limit: int = 3  # resubmits of one request after a worker failure; 0: none
    cors_origins: tuple[str, ...] = ()  # origins browsers may call /v1/* from; "*": any
    sse_heartbeat: float = 15.0  # seconds of silence before an SSE comment line

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if min(self.request_timeout, self.stall_timeout, self.submit_timeout) <= 0:
            raise ValueError("timeouts must be positive")
        if self.sse_heartbeat <= 0:
            raise ValueError("sse_heartbeat must be positive")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        model_dir = Path(args.model_dir)
        return cls(
            common=CommonConfig.from_args(args),
            model_dir=model_dir,
            served_model_name=args.served_model_name or model_dir.name,
            gateway_id=args.gateway_id or f"gw-{uuid.uuid4().hex[:8]}",
            max_model_len=args.max_model_len or model_max_len(model_dir),
            host=args.host,
            port=args.port,
            api_keys=tuple(k for k in args.api_key if k),
            request_timeout=args.request_timeout,
            stall_timeout=args.stall_timeout,
            max_pending=args.max_pending,
            migration_limit=args.migration_limit,
            cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
            sse_heartbeat=args.sse_heartbeat,
        )


def model_max_len(model_dir: Path) -> int:
    """max_position_embeddings from the model's config.json."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return int(config["max_position_embeddings"])
