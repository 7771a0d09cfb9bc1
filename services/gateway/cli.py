"""`splitserve gateway`: flags → GatewayConfig → the aiohttp server."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from shared.config import add_common_args, env


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("gateway", help="OpenAI-compatible HTTP gateway")
    parser.add_argument("--host", default=env("host", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=env("port", 8000, int))
    parser.add_argument("--model-dir", required=True, help="tokenizer and chat template")
    parser.add_argument("--served-model-name", help="default: the model directory's name")
    parser.add_argument("--gateway-id", default=env("gateway_id", ""), help="default: random")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[k.strip() for k in env("api_keys", "").split(",")],
        help="repeatable; also SPLITSERVE_API_KEYS (comma-separated); none: no auth",
    )
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=env("stall_timeout", 60.0, float),
        help="seconds without a token before the request migrates (or fails)",
    )
    parser.add_argument(
        "--max-model-len", type=int, help="default: max_position_embeddings of config.json"
    )
    parser.add_argument(
        "--max-pending", type=int, default=env("max_pending", 256, int), help="requests in flight"
    )
    parser.add_argument(
        "--migration-limit",
        type=int,
        default=env("migration_limit", 3, int),
        help="resubmits of a request whose worker failed; 0: none",
    )
    parser.add_argument(
        "--cors-origins",
        default=env("cors_origins", ""),
        help="comma-separated origins allowed to call /v1/* from a browser; '*': any; "
        "also SPLITSERVE_CORS_ORIGINS; default: none",
    )
    parser.add_argument(
        "--sse-heartbeat", type=float, default=15.0, help="seconds of stream silence per comment"
    )
    add_common_args(parser)
    parser.set_defaults(func=_run)
    return parser


def _run(args: argparse.Namespace) -> None:
    from services.gateway.app import run
    from services.gateway.config import GatewayConfig

    logging.basicConfig(level=args.log_level.upper())
    run(GatewayConfig.from_args(args))
