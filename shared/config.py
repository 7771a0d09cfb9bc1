"""Settings shared by every service, filled from CLI flags with `SPLITSERVE_*` env defaults.

Each service's own frozen config dataclass lives in its package (services/<name>/config.py)
and builds on `add_common_args` / `env`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from shared.subjects import DEFAULT_NAMESPACE

if TYPE_CHECKING:
    from shared.nats_options import NatsAuth

T = TypeVar("T")


def env(name: str, default: T, parse: Callable[[str], T] = str) -> T:
    """`SPLITSERVE_<NAME>` parsed, or `default` when unset."""
    raw = os.environ.get(f"SPLITSERVE_{name.upper()}")
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise SystemExit(f"SPLITSERVE_{name.upper()}={raw!r}: {exc}") from None


def add_common_args(parser: argparse.ArgumentParser) -> None:
    from shared.flags import add_flags  # shared.flags imports this module: not at the top
    from shared.nats_options import NatsAuth

    parser.add_argument(
        "--nats",
        default=env("nats", "nats://127.0.0.1:4222"),
        help="NATS server URL, or a cluster's URLs comma-separated (failover between them)",
    )
    add_flags(parser, NatsAuth)
    parser.add_argument(
        "--namespace", default=env("namespace", DEFAULT_NAMESPACE), help="subject prefix"
    )
    parser.add_argument("--log-level", default=env("log_level", "INFO"))
    parser.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        help="OTLP/HTTP base URL for traces (default: OTEL_EXPORTER_OTLP_ENDPOINT; none: off)",
    )


def add_metrics_port_arg(parser: argparse.ArgumentParser) -> None:
    """`--metrics-port` of the services without an HTTP port of their own."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=env("metrics_port", 0, int),
        help="Prometheus /metrics port (0: a free one, printed at start)",
    )


@dataclass(frozen=True, slots=True)
class CommonConfig:
    nats_url: str
    namespace: str
    log_level: str
    otlp_endpoint: str = ""  # "": traces are not exported
    nats_auth: NatsAuth | None = None  # None: anonymous, no TLS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CommonConfig:
        from shared.flags import build
        from shared.nats_options import NatsAuth

        auth = build(NatsAuth, args)
        return cls(args.nats, args.namespace, args.log_level, args.otlp_endpoint, auth)
