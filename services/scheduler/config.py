"""The scheduler's settings: one frozen dataclass filled from CLI flags (`SPLITSERVE_*` env)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.config import CommonConfig, add_common_args, add_metrics_port_arg, env
from shared.subjects import DEFAULT_NAMESPACE


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    namespace: str = DEFAULT_NAMESPACE
    log_level: str = "INFO"
    max_queue: int = 256  # requests being placed at once; beyond → refused with retry_after
    local_prefill_tokens: int = 16  # at most this many uncached tokens: decode prefills itself
    block_size: int = 16  # must match the workers' KV block size
    model_id: str = ""  # block-hash model id until a worker's heartbeat names its model
    # Seconds for each Reserve / PrefillTask / DecodeTask reply. A worker answers between
    # engine steps, and one step of a long prefill chunk takes seconds on a CPU.
    reserve_timeout: float = 10.0
    load_penalty: float = 1.0  # cached blocks one queued or running request is worth
    heartbeat_timeout: float = 3.0  # 3 missed 1 s heartbeats: the worker is gone
    sweep_interval: float = 0.5  # how often expiry and request deadlines are checked
    retry_after: float = 1.0  # what a refusal for load or missing workers advises
    otlp_endpoint: str = ""  # traces over OTLP/HTTP; "": off
    metrics_port: int = 0  # Prometheus /metrics; 0: a free port

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        for name in ("reserve_timeout", "heartbeat_timeout", "sweep_interval", "retry_after"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SchedulerConfig:
        common = CommonConfig.from_args(args)
        return cls(
            nats_url=common.nats_url,
            namespace=common.namespace,
            log_level=common.log_level,
            max_queue=args.max_queue,
            local_prefill_tokens=args.local_prefill_tokens,
            block_size=args.block_size,
            reserve_timeout=args.reserve_timeout,
            load_penalty=args.load_penalty,
            heartbeat_timeout=args.heartbeat_timeout,
            otlp_endpoint=common.otlp_endpoint,
            metrics_port=args.metrics_port,
        )


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    defaults = SchedulerConfig()
    add_common_args(parser)
    add_metrics_port_arg(parser)
    parser.add_argument(
        "--max-queue",
        type=int,
        default=env("max_queue", defaults.max_queue, int),
        help="requests placed at once; beyond this, submits are refused with retry_after",
    )
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=env("local_prefill_tokens", defaults.local_prefill_tokens, int),
        help="a prompt with at most this many tokens uncached on its decode worker skips prefill",
    )
    parser.add_argument(
        "--block-size", type=int, default=env("block_size", defaults.block_size, int)
    )
    parser.add_argument(
        "--reserve-timeout",
        type=float,
        default=env("reserve_timeout", defaults.reserve_timeout, float),
        help="seconds to wait for a worker's answer to Reserve, PrefillTask or DecodeTask",
    )
    parser.add_argument(
        "--load-penalty",
        type=float,
        default=env("load_penalty", defaults.load_penalty, float),
        help="cached prefix blocks that one queued or running request on a worker outweighs",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=env("heartbeat_timeout", defaults.heartbeat_timeout, float),
        help="seconds without a heartbeat before a worker counts as lost",
    )
