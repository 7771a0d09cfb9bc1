"""Settings shared by every service: `CommonConfig`, one field (`common`) of each service's own
frozen config (services/<name>/config.py), filled from CLI flags with `SPLITSERVE_*` defaults.

Each setting is declared once, with `flag()` (shared/flags.py): `add_common_args` makes the
flags, `CommonConfig.from_args` the config. The subtle rule: `--otlp-endpoint` defaults to
the OpenTelemetry SDK's own variable, OTEL_EXPORTER_OTLP_ENDPOINT, not a SPLITSERVE_* one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.flags import add_flags, build, env, flag
from shared.nats_options import NatsAuth
from shared.subjects import DEFAULT_NAMESPACE

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True, slots=True)
class CommonConfig:
    nats_url: str = flag(
        DEFAULT_NATS_URL,
        name="--nats",
        variable="SPLITSERVE_NATS",
        help="NATS server URL, or a cluster's URLs comma-separated (failover between them)",
    )
    namespace: str = flag(DEFAULT_NAMESPACE, help="subject prefix")
    log_level: str = flag("INFO", help="DEBUG, INFO, WARNING or ERROR")
    otlp_endpoint: str = flag(
        "",
        variable="OTEL_EXPORTER_OTLP_ENDPOINT",
        help="OTLP/HTTP base URL for traces (none: off)",
    )
    nats_auth: NatsAuth | None = None  # None: anonymous, no TLS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CommonConfig:
        return build(cls, args, nats_auth=build(NatsAuth, args))


def add_common_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CommonConfig)
    add_flags(parser, NatsAuth)


def add_metrics_port_arg(parser: argparse.ArgumentParser) -> None:
    """`--metrics-port` of the services without an HTTP port of their own."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=env("SPLITSERVE_METRICS_PORT", 0, int),
        help="Prometheus /metrics port (0: a free one, printed at start)",
    )
