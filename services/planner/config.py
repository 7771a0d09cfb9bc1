"""The planner's settings: the policy's (`PlannerConfig`, what `Planner` decides by) and the
service's (`PlannerServiceConfig`: NATS, the objectives as `--slo`, how often and over what
window it looks), each filled from flags with `SPLITSERVE_PLANNER_*` defaults.

The subtle rule: `PlannerConfig` builds from Python with keyword defaults alone (the simulator
does), so its objectives are plain fields; the command line sets them from one flag, `--slo
ttft=SECONDS,tpot=SECONDS` (shared/slo.py), and the mode from `--planner-mode`, whose `auto` is
`replicas` for the service alone and `roles` under `splitserve up --pool` (launch_plan.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from shared.config import CommonConfig, add_common_args, add_metrics_port_arg
from shared.errors import ConfigError
from shared.flags import add_flags, build, flag
from shared.slo import parse_slo

MODES = ("roles", "replicas")
MODE_CHOICES = ("auto", *MODES)
SIGNALS = ("latency", "demand")
DEFAULT_SLO = "ttft=1,tpot=0.04"


def _flag(default: object, name: str, help: str, **more: Any) -> Any:
    """A `--planner-NAME` flag read from `SPLITSERVE_PLANNER_NAME`."""
    variable = "SPLITSERVE_PLANNER_" + name.upper().replace("-", "_")
    return flag(default, name=f"--planner-{name}", variable=variable, help=help, **more)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """What the policy decides by (services/planner/policy.py says how)."""

    mode: str = "replicas"  # roles: SET_ROLE among the workers there are; replicas: ADD/DRAIN
    ttft_slo: float = 1.0  # seconds: the objective for time to first token, at p99
    tpot_slo: float = 0.04  # seconds: the objective for time per output token, at p99
    signals: str = _flag(
        "latency",
        "signals",
        "what the needs come from: latency (TTFT and TPOT p99 over the window), or demand "
        "(the prompt work and streams in flight against the measured rates, on a mesh split "
        "into prefill and decode workers; services/planner/demand.py)",
        choices=SIGNALS,
    )
    hold: int = _flag(3, "hold", "snapshots in a row a need must show before the planner acts")
    cooldown: float = _flag(60.0, "cooldown", "seconds after a decision before the next one")
    settle: float = _flag(
        300.0,
        "settle",
        "seconds to wait for the mesh to show a decision's effect (a new worker loading its "
        "model) before deciding again anyway",
    )
    min_samples: int = _flag(
        5, "min-samples", "TTFT or TPOT samples in the window before its p99 counts"
    )
    margin: float = _flag(
        0.8,
        "margin",
        "objectives count as met at p99 <= margin x SLO (scaling down needs both met); the "
        "prefill queue counts as too long at margin x the TTFT objective",
    )
    busy_low: float = _flag(0.2, "busy-low", "a side this busy (share of time in steps) is idle")
    kv_high: float = _flag(0.9, "kv-high", "decode KV usage at which the decode side is full")
    min_per_role: int = _flag(1, "min-per-role", "replicas mode: fewest workers of a role kept")
    max_per_role: int = _flag(4, "max-per-role", "replicas mode: most workers of a role asked for")
    max_moves: int = _flag(2, "max-moves", "roles mode: most workers that change role per decision")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"planner mode must be one of {MODES}, got {self.mode!r}")
        if min(self.ttft_slo, self.tpot_slo) <= 0:
            raise ConfigError("the TTFT and TPOT objectives must be > 0 seconds")
        if self.hold < 1 or self.min_samples < 1:
            raise ConfigError("--planner-hold and --planner-min-samples must be >= 1")
        if self.cooldown < 0 or self.settle < 0:
            raise ConfigError("--planner-cooldown and --planner-settle must be >= 0")
        if not (0 < self.margin <= 1 and 0 <= self.busy_low < 1 and 0 < self.kv_high <= 1):
            raise ConfigError("need 0 < margin <= 1, 0 <= busy-low < 1 and 0 < kv-high <= 1")
        if self.max_moves < 1:
            raise ConfigError("--planner-max-moves must be >= 1")
        if not 0 <= self.min_per_role <= self.max_per_role or self.max_per_role < 1:
            raise ConfigError("need 0 <= --planner-min-per-role <= --planner-max-per-role >= 1")


@dataclass(frozen=True, slots=True)
class PlannerServiceConfig:
    common: CommonConfig = field(default_factory=CommonConfig)
    policy: PlannerConfig = field(default_factory=PlannerConfig)
    slo: str = flag(
        DEFAULT_SLO,
        help="the objectives at p99: ttft=SECONDS,tpot=SECONDS (or 200ms)",
        variable="SPLITSERVE_PLANNER_SLO",
    )
    planner_mode: str = flag(
        "auto",
        help="roles: change the roles of the workers there are; replicas: ask for workers to be "
        "added and drained; auto: roles under `up --pool`, else replicas",
        choices=MODE_CHOICES,
    )
    planner_interval: float = flag(5.0, help="seconds between two decisions")
    planner_window: float = flag(60.0, help="seconds of TTFT and TPOT samples a decision sees")
    planner_model: str = flag("", help="plan this model's workers ('': a mesh of one model)")
    planner_id: str = flag("planner", help="this planner's name in its PoolTargets and logs")
    role_timeout: float = 5.0  # seconds for a worker's answer to SetRole (it answers at once)
    heartbeat_timeout: float = 3.0  # a worker silent this long is left out of the snapshot
    metrics_port: int = 0  # Prometheus /metrics; 0: a free one

    def __post_init__(self) -> None:
        if self.planner_interval <= 0 or self.planner_window <= 0:
            raise ConfigError("--planner-interval and --planner-window must be > 0")
        if not self.planner_id.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"--planner-id {self.planner_id!r}: letters, digits, - or _")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlannerServiceConfig:
        ttft, tpot = parse_slo(args.slo)
        mode = "replicas" if args.planner_mode == "auto" else args.planner_mode
        policy = build(PlannerConfig, args, mode=mode, ttft_slo=ttft, tpot_slo=tpot)
        common = CommonConfig.from_args(args)
        return build(cls, args, common=common, policy=policy, metrics_port=args.metrics_port)


def add_planner_flags(parser: argparse._ActionsContainer) -> None:
    """The planner's own flags (`splitserve planner`, and `up`'s planner group)."""
    add_flags(parser, PlannerServiceConfig)
    add_flags(parser, PlannerConfig)


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    add_metrics_port_arg(parser)
    add_planner_flags(parser)
