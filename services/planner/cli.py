"""`splitserve planner`: run the planner until SIGTERM / Ctrl-C (NATS user `planner`)."""

from __future__ import annotations

import argparse
import logging
import sys

from services.planner.config import PlannerServiceConfig, add_planner_args
from services.planner.service import PlannerService
from shared.bus import Bus
from shared.errors import ConfigError
from shared.service_loop import log_to_stderr, run, run_until_signal
from shared.telemetry.metrics import serve_metrics

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "planner", help="choose roles and pool sizes from the SLO and the live signals"
    )
    add_planner_args(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    try:
        config = PlannerServiceConfig.from_args(args)
    except ConfigError as exc:
        sys.exit(f"splitserve planner: {exc}")
    log_to_stderr(config.common.log_level)
    run(serve(config))


class PlannerProcess:
    """The planner's connection, service and /metrics: `start`, then `shutdown`."""

    def __init__(self, config: PlannerServiceConfig) -> None:
        self.config = config
        self.bus: Bus | None = None
        self.service: PlannerService | None = None

    async def start(self) -> None:
        config = self.config
        self.bus = await Bus.connect(
            config.common.nats_url, "planner", auth=config.common.nats_auth
        )
        self.service = PlannerService(config, self.bus)
        self.service.metrics.registry.register(self.bus.rejections.counter)
        port = serve_metrics(self.service.metrics.registry, config.metrics_port)
        print(f"planner metrics on port {port}", flush=True)
        await self.service.start()
        policy = config.policy
        log.info(
            "planner ready (%s mode, SLO TTFT %.3f s, TPOT %.3f s at p99)",
            policy.mode, policy.ttft_slo, policy.tpot_slo,
        )  # fmt: skip

    async def shutdown(self) -> None:
        if self.service is not None:
            await self.service.stop()
        if self.bus is not None:
            await self.bus.close()
        if self.service is not None:
            self.service.tracing.shutdown()


async def serve(config: PlannerServiceConfig) -> None:
    planner = PlannerProcess(config)
    await run_until_signal(planner.start, planner.shutdown)
