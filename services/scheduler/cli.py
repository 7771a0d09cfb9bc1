"""`splitserve scheduler`: run one scheduler replica until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from services.scheduler.config import SchedulerConfig, add_scheduler_args
from services.scheduler.service import SchedulerService
from shared.bus import Bus
from shared.telemetry.metrics import serve_metrics

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("scheduler", help="place requests on prefill/decode workers")
    add_scheduler_args(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    config = SchedulerConfig.from_args(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(config))


async def serve(config: SchedulerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service: SchedulerService | None = None

    async def reconnected() -> None:
        if service is not None:
            service.on_reconnect()

    bus = await Bus.connect(config.nats_url, "scheduler", on_reconnect=reconnected)
    service = SchedulerService(config, bus)
    port = serve_metrics(service.metrics.registry, config.metrics_port)
    print(f"scheduler metrics on port {port}", flush=True)
    await service.start()
    log.info("scheduler ready on %s (namespace %s)", config.nats_url, config.namespace)
    await stop.wait()
    log.info("scheduler stopping")
    await service.stop()
    await bus.close()
    service.tracing.shutdown()
