"""`splitserve scheduler`: run one scheduler replica until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import logging

from services.scheduler.config import SchedulerConfig, add_scheduler_args
from services.scheduler.service import SchedulerService
from shared.bus import Bus
from shared.service_loop import log_to_stderr, run, run_until_signal
from shared.telemetry.metrics import serve_metrics

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("scheduler", help="place requests on prefill/decode workers")
    add_scheduler_args(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    config = SchedulerConfig.from_args(args)
    log_to_stderr(config.common.log_level)
    run(serve(config))


class SchedulerProcess:
    """The scheduler's connection, service and /metrics: `start`, then `shutdown`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.bus: Bus | None = None
        self.service: SchedulerService | None = None

    async def start(self) -> None:
        config = self.config
        self.bus = await Bus.connect(
            config.common.nats_url,
            "scheduler",
            on_reconnect=self._reconnected,
            auth=config.common.nats_auth,
        )
        self.service = SchedulerService(config, self.bus)
        self.service.metrics.registry.register(self.bus.rejections.counter)
        port = serve_metrics(self.service.metrics.registry, config.metrics_port)
        print(f"scheduler metrics on port {port}", flush=True)
        await self.service.start()
        common = config.common
        log.info("scheduler ready on %s (namespace %s)", common.nats_url, common.namespace)

    async def shutdown(self) -> None:
        log.info("scheduler stopping")
        if self.service is not None:
            await self.service.stop()
        if self.bus is not None:
            await self.bus.close()
        if self.service is not None:
            self.service.tracing.shutdown()

    async def _reconnected(self) -> None:
        if self.service is not None:
            self.service.on_reconnect()


async def serve(config: SchedulerConfig) -> None:
    scheduler = SchedulerProcess(config)
    await run_until_signal(scheduler.start, scheduler.shutdown)
