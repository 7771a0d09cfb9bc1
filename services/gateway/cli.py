"""`splitserve gateway`: flags → GatewayConfig → the aiohttp server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from services.gateway.config import GatewayConfig
from shared.config import add_common_args
from shared.flags import add_flags
from shared.service_loop import run, run_until_signal

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("gateway", help="OpenAI-compatible HTTP gateway")
    add_flags(parser, GatewayConfig)
    add_common_args(parser)
    parser.set_defaults(func=_run)
    return parser


def _run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the app can reload (reload.py)
    run(serve(GatewayConfig.from_args(args)))


async def serve(config: GatewayConfig) -> None:
    """Serve until SIGTERM or SIGINT, then stop intake and drain the NATS connection."""
    from aiohttp import web

    from services.gateway.app import create_runner  # aiohttp loads here, not at parsing
    from services.gateway.reload import hangup_handler

    runner = create_runner(config)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        if config.mesh_config is not None:  # SIGHUP: read the mesh config again
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, hangup_handler(runner.app))
        log.info("gateway %s on http://%s:%d", config.gateway_id, config.host, config.port)

    await run_until_signal(start, runner.cleanup)
