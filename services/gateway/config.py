"""GatewayConfig: the gateway's settings, frozen, filled from CLI flags and SPLITSERVE_* env.

The fields declared with `flag(...)` are the gateway's flags (`shared/flags.py`).
"""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.gateway.tool_parsers import PARSERS
from shared.config import CommonConfig
from shared.errors import ConfigError
from shared.flags import build, flag


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    common: CommonConfig
    # tokenizer.json, tokenizer_config.json (chat template), config.json
    model_dir: Path = flag(help="tokenizer and chat template")
    served_model_name: str = flag(unset="", help="default: the model directory's name")
    # tokens come back on <ns>.gateway.<gateway_id>.tokens
    gateway_id: str = flag(unset="", help="default: random")
    # prompt tokens + max_tokens may not exceed it
    max_model_len: int = flag(unset=None, help="default: max_position_embeddings of config.json")
    host: str = flag("127.0.0.1", help="HTTP bind address")
    port: int = flag(8000, help="HTTP port")
    api_keys: tuple[str, ...] = flag(
        (), name="--api-key", help="repeatable or comma-separated; none: no auth"
    )
    # Read into api_keys by from_args (services/gateway/limits.py: keys are never logged).
    api_key_file: Path | None = flag(None, help="more API keys, one a line (a mounted Secret)")
    max_body_bytes: int = flag(8 * 2**20, help="largest request body; beyond: 413")
    key_concurrency: int = flag(
        0, help="requests in flight per API key (all callers, without keys); beyond: 429; 0: any"
    )
    key_rate: float = flag(
        0.0, help="requests a second per API key; beyond: 429 with Retry-After; 0: any"
    )
    key_burst: int = flag(10, help="requests a key may start at once within --key-rate")
    request_timeout: float = flag(600.0, help="seconds from arrival to the last token")
    stall_timeout: float = flag(
        60.0, help="seconds without a token before the request migrates (or fails)"
    )
    # Seconds to wait for the scheduler's SubmitAck. The scheduler holds a request it has no
    # room for up to its --queue-timeout (60 s) and then answers: keep this comfortably above.
    submit_timeout: float = 90.0
    # Seconds a submit that no scheduler subscribes to is asked again (every 0.1 s) before the
    # 503: one restarting, or reconnecting to another NATS node after its own died.
    scheduler_grace: float = 5.0
    max_pending: int = flag(256, help="requests in flight; more are refused with 429")
    migration_limit: int = flag(3, help="resubmits of a request whose worker failed; 0: none")
    cors_origins: tuple[str, ...] = flag(
        (),
        help="comma-separated origins allowed to call /v1/* from a browser; '*': any; "
        "default: none",
    )
    sse_heartbeat: float = flag(15.0, help="seconds of stream silence per keep-alive comment")
    tool_call_parser: str = flag(
        "auto",
        choices=("auto", *PARSERS),
        help="how tool calls are read from replies; auto: from the chat template",
    )
    mesh_config: Path | None = flag(
        None, help="a mesh config (several models, routes, fallbacks; docs/mesh-config.md)"
    )
    swap_ramp: float = flag(
        30.0,
        help="seconds a route takes to move its traffic from a reloaded mesh config's old "
        "targets to its new ones (SIGHUP, POST /admin/reload)",
    )

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        if min(self.request_timeout, self.stall_timeout, self.submit_timeout) <= 0:
            raise ConfigError("timeouts must be positive")
        if self.scheduler_grace < 0:
            raise ConfigError("scheduler_grace must be >= 0")
        if self.swap_ramp < 0:
            raise ConfigError("swap_ramp must be >= 0 seconds")
        if self.sse_heartbeat <= 0:
            raise ConfigError("sse_heartbeat must be positive")
        if self.max_pending < 1:
            raise ConfigError("max_pending must be >= 1")
        if self.migration_limit < 0:
            raise ConfigError("migration_limit must be >= 0")
        if self.max_body_bytes < 1 or min(self.key_concurrency, self.key_rate, self.key_burst) < 0:
            raise ConfigError("max_body_bytes must be >= 1, key limits >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        model_dir: Path = args.model_dir
        return build(
            cls,
            args,
            common=CommonConfig.from_args(args),
            served_model_name=args.served_model_name or model_dir.name,
            gateway_id=args.gateway_id or f"gw-{uuid.uuid4().hex[:8]}",
            max_model_len=args.max_model_len or model_max_len(model_dir),
            api_keys=(*args.api_keys, *read_key_file(args.api_key_file)),
        )


def read_key_file(path: Path | None) -> tuple[str, ...]:
    """API keys from `path`, one a line ('#' comments and blank lines skipped)."""
    if path is None:
        return ()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SystemExit(f"--api-key-file {path}: {exc.strerror}") from None
    return tuple(s for line in lines if (s := line.strip()) and not s.startswith("#"))


def model_max_len(model_dir: Path) -> int:
    """max_position_embeddings from the model's config.json."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return int(config["max_position_embeddings"])
