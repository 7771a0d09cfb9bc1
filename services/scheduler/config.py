"""The scheduler's settings: one frozen dataclass filled from CLI flags (`SPLITSERVE_*` env).

The fields declared with `flag(...)` are the scheduler's own flags (`shared/flags.py`); the
settings every service shares are `common`. `block_size` is declared once, with the engine's
(`block_size_flag`): `up` passes one `--block-size` to the workers and the scheduler.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from shared.config import CommonConfig, add_common_args, add_metrics_port_arg
from shared.engine.engine_config import block_size_flag, check_block_size
from shared.errors import ConfigError
from shared.flags import add_flags, build, flag
from shared.slo import parse_slo

PATH_CHOICES = ("auto", "cost", "fixed", "slo")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # NATS URL, credentials (the scheduler role's), namespace, log level, trace export
    common: CommonConfig = field(default_factory=CommonConfig)
    max_queue: int = flag(
        256,
        help="requests being placed or waiting for room; beyond this, submits are refused "
        "at once (429 with retry_after)",
    )
    # The fixed rule (the default, and --path-choice cost's cold start until the workers
    # have measured their costs, path_cost.py): a prompt this short skips the prefill workers.
    local_prefill_tokens: int = flag(
        16,
        help="before costs are measured (or with --path-choice fixed): a prompt with at most "
        "this many tokens uncached on its decode worker skips prefill",
    )
    path_choice: str = flag(
        "auto",
        help="fixed: the --local-prefill-tokens rule; cost: each request split or prefilled "
        "where it decodes, by measured cost (the prediction and its error are recorded "
        "either way); slo: the path that keeps --path-slo's objectives, then by cost; "
        "auto: slo when --path-slo is given, else fixed",
        choices=PATH_CHOICES,
    )
    path_slo: str = flag(
        "",
        help="--path-choice slo: the objectives ttft=SECONDS,tpot=SECONDS (or 200ms) the path "
        "choice keeps for the new request and the streams running where it would decode",
    )
    stall_weight: float = flag(
        0.1,
        help="seconds of a new request's TTFT that one second of a running stream's stall is "
        "worth, when a decode worker would prefill it itself",
    )
    block_size: int = block_size_flag()
    model_id: str = ""  # block-hash model id until a worker's heartbeat names its model
    # Seconds for each Reserve / PrefillTask / DecodeTask reply. Workers answer at once (not
    # after an engine step), so running out of it means a lost or wedged worker.
    reserve_timeout: float = flag(
        10.0, help="seconds to wait for a worker's answer to Reserve, PrefillTask or DecodeTask"
    )
    load_penalty: float = flag(
        1.0, help="cached prefix blocks that one queued or running request on a worker outweighs"
    )
    lora_affinity: float = flag(
        4.0,
        help="cached prefix blocks that a worker with the request's LoRA adapter already in a "
        "slot is worth (against --load-penalty per request: a busy worker loses it)",
    )
    kv_peer_reads: bool = flag(
        False,
        help="tell the worker computing a prompt which other worker holds more of its prefix "
        "in its pool, to read those blocks by its one-sided KV transport (nixl) when that "
        "is measured cheaper than computing them (docs/kv_tier.md)",
    )
    # 3 missed 1 s heartbeats: the worker is gone
    heartbeat_timeout: float = flag(
        3.0, help="seconds without a heartbeat before a worker counts as lost"
    )
    # A worker silent past heartbeat_timeout is probed (liveness.py); lost when the probe
    # finds no subscriber at once, or gets no answer from its process by this deadline.
    probe_timeout: float = flag(
        3.0,
        help="seconds a silent worker has to answer the scheduler's probe before it counts "
        "as lost (a frozen worker is lost after heartbeat_timeout + this)",
    )
    # A submit no worker has room for waits (in arrival order) at most this long, and never
    # past its deadline, then is refused with 503. The gateway's submit_timeout must exceed it.
    queue_timeout: float = flag(
        60.0, help="seconds a request waits for a worker with room before it is refused (503)"
    )
    # Shedding by class (waiting.py): beyond this share of max_queue placing or waiting, a
    # submit that would be served after every waiting one is refused at once (429).
    shed_share: float = flag(
        0.75,
        help="share of --max-queue beyond which a submit that would be served last (by "
        "priority, then its tenant's tokens) is refused at once (429); 1: never",
    )
    sweep_interval: float = 0.5  # expiry, request deadlines; waiters retry at least this often
    retry_after: float = 1.0  # what a refusal for load or missing workers advises
    metrics_port: int = 0  # Prometheus /metrics; 0: a free port
    # (ttft, tpot) seconds read from path_slo under --path-choice slo; (0, 0): none
    objectives: tuple[float, float] = field(init=False, default=(0.0, 0.0))

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        check_block_size(self.block_size)
        if self.local_prefill_tokens < 0:
            raise ConfigError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        if self.path_choice not in PATH_CHOICES:
            raise ConfigError(f"path_choice must be one of {PATH_CHOICES}, got {self.path_choice}")
        if self.path_choice == "auto":  # resolved here: the services see the rule they run
            object.__setattr__(self, "path_choice", "slo" if self.path_slo else "fixed")
        if self.path_choice == "slo":
            if not self.path_slo:
                raise ConfigError("--path-choice slo needs --path-slo ttft=SECONDS,tpot=SECONDS")
            object.__setattr__(self, "objectives", parse_slo(self.path_slo, "--path-slo"))
        if not 0 < self.shed_share <= 1:
            raise ConfigError(f"shed_share must be in (0, 1], got {self.shed_share}")
        if self.stall_weight < 0:
            raise ConfigError(f"stall_weight must be >= 0, got {self.stall_weight}")
        timeouts = ("reserve_timeout", "heartbeat_timeout", "probe_timeout", "queue_timeout")
        timeouts += ("sweep_interval",)
        for name in (*timeouts, "retry_after"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SchedulerConfig:
        common = CommonConfig.from_args(args)
        return build(cls, args, common=common, metrics_port=args.metrics_port)


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    add_metrics_port_arg(parser)
    add_flags(parser, SchedulerConfig)
