"""`splitserve scale --role ROLE --replicas N`: ask `splitserve up` for N workers of a role.

It connects as the planner does (`--nats-user planner ...`: PoolTargets are the planner's
to publish), reads the live workers per role from the scheduler's status, publishes a whole
PoolTarget (shared/pool_messages.py): the other roles at their live counts, ROLE at N,
publisher "scale", seq_no from the clock, so a later command always wins over an earlier
one. Then it waits (`--wait` seconds) until the status shows N live workers of ROLE: exit
status 0 then, 1 when no scheduler answers or the count is not reached in time (with the
counts it saw; `up`'s log says why it did not add or drain).

The subtle rule: counts are the launcher's (services/pool_reconcile.py: live_counts): a
worker mid-change counts for its next role, a draining one not at all.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field

from nats.errors import NoRespondersError

from services.pool_reconcile import live_counts
from shared.bus import Bus
from shared.config import CommonConfig, add_common_args
from shared.errors import ConfigError
from shared.flags import add_flags, build, flag
from shared.pool_messages import PoolTarget
from shared.protocol import ROLES, MeshStatus, StatusQuery
from shared.subjects import Subjects

PUBLISHER = "scale"
STATUS_TIMEOUT_S = 5.0
POLL_S = 0.5  # between two looks at the status while waiting


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleCommand:
    role: str = flag(choices=ROLES, help="the role to scale", variable=None)
    replicas: int = flag(help="how many workers of that role `up` should run", variable=None)
    model: str = flag("", help="the served model's name ('': the mesh serves one)", variable=None)
    reason: str = flag("asked by splitserve scale", help="logged by up with each change",
                       variable=None)  # fmt: skip
    wait: float = flag(
        300.0, help="seconds to wait for the scheduler to show the count", variable=None
    )
    common: CommonConfig = field(default_factory=CommonConfig)

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ConfigError("--replicas must be >= 0")
        if self.wait <= 0:
            raise ConfigError("--wait must be positive")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scale", help="ask splitserve up for N workers of a role (a PoolTarget)"
    )
    add_flags(parser, ScaleCommand)
    add_common_args(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    try:
        command = build(ScaleCommand, args, common=CommonConfig.from_args(args))
    except ConfigError as exc:
        sys.exit(f"splitserve scale: {exc}")
    ok, message = asyncio.run(scale(command))
    print(message)
    if not ok:
        sys.exit(1)


def target_for(command: ScaleCommand, status: MeshStatus, seq_no: int) -> PoolTarget:
    """The whole state wanted: the live counts, `command.role` at `command.replicas`."""
    live = live_counts(status)
    wanted = [command.replicas if role == command.role else live[role] for role in ROLES]
    return PoolTarget(PUBLISHER, seq_no, command.model, *wanted, command.reason)


async def scale(command: ScaleCommand) -> tuple[bool, str]:
    """(reached, what happened)."""
    common, role = command.common, command.role
    subjects = Subjects(common.namespace)
    try:
        bus = await Bus.connect(common.nats_url, "scale-cli", auth=common.nats_auth)
    except ConnectionError as exc:
        return False, str(exc)

    async def status() -> MeshStatus:
        return await bus.request(subjects.status, StatusQuery(), MeshStatus, STATUS_TIMEOUT_S)

    try:
        try:
            seen = await status()
        except (NoRespondersError, TimeoutError):
            return False, f"no scheduler answers on {subjects.status}"
        target = target_for(command, seen, time.time_ns())
        await bus.publish(subjects.pool_target, target)
        print(f"asked for {_counts(target)}", flush=True)
        deadline = time.monotonic() + command.wait
        while (count := live_counts(seen)[role]) != command.replicas:
            if time.monotonic() >= deadline:
                return False, (
                    f"{count} {role} worker(s) after {command.wait} s, not {command.replicas} "
                    "(is splitserve up following pool targets? its log says why not)"
                )
            await asyncio.sleep(POLL_S)
            try:
                seen = await status()
            except (NoRespondersError, TimeoutError):
                continue  # a scheduler restarting: asked again until the deadline
        return True, f"{command.replicas} {role} worker(s) serving"
    finally:
        await bus.close()


def _counts(target: PoolTarget) -> str:
    return ", ".join(f"{role} {target.wanted(role)}" for role in ROLES)
