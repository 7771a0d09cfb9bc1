"""`splitserve role --worker ID --role ROLE [--hurry]`: change a worker's role while it serves.

It connects as the scheduler does (`--nats-user scheduler ...`: SetRole is the scheduler's
to send), sends `SetRole` to the worker, prints its answer, then waits for the heartbeat
that announces the new role (`--wait` seconds at most). Exit status 0 once announced, 1 when
refused, unanswered or not announced in time. The planner sends the same message.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field

from nats.errors import NoRespondersError

from shared.bus import Bus, Headers
from shared.config import CommonConfig, add_common_args
from shared.errors import ConfigError
from shared.flags import add_flags, build, flag
from shared.protocol import ROLES, Heartbeat, SetRole, TaskAck
from shared.subjects import Subjects

ANSWER_TIMEOUT_S = 5.0  # the worker answers at once: the change itself runs after the answer


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleCommand:
    worker: str = flag(help="the worker's id (its heartbeat's worker_id)", variable=None)
    role: str = flag(choices=ROLES, help="the role it serves from now on", variable=None)
    hurry: bool = flag(
        False,
        help="fail the dropped role's running streams at once (their gateways migrate them) "
        "rather than let them finish",
        variable=None,
    )
    wait: float = flag(
        120.0, help="seconds to wait for the heartbeat announcing the new role", variable=None
    )
    common: CommonConfig = field(default_factory=CommonConfig)

    def __post_init__(self) -> None:
        if self.wait <= 0:
            raise ConfigError("--wait must be positive")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("role", help="change a worker's role while it serves")
    add_flags(parser, RoleCommand)
    add_common_args(parser)
    parser.set_defaults(func=main)


def command_from_args(args: argparse.Namespace) -> RoleCommand:
    return build(RoleCommand, args, common=CommonConfig.from_args(args))


def main(args: argparse.Namespace) -> None:
    try:
        command = command_from_args(args)
    except ConfigError as exc:
        sys.exit(f"splitserve role: {exc}")
    ok, message = asyncio.run(change_role(command))
    print(message)
    if not ok:
        sys.exit(1)


async def change_role(command: RoleCommand) -> tuple[bool, str]:
    """(announced, what happened)."""
    common, worker = command.common, command.worker
    subjects = Subjects(common.namespace)
    bus = await Bus.connect(common.nats_url, "role-cli", auth=common.nats_auth)
    announced = asyncio.Event()

    async def on_beat(beat: Heartbeat, headers: Headers) -> None:
        if beat.worker_id == worker and beat.role == command.role and not beat.next_role:
            announced.set()

    try:
        await bus.subscribe(subjects.heartbeat, Heartbeat, on_beat)  # before it can change
        message = SetRole(command.role, command.hurry)
        try:
            ack = await bus.request(subjects.role(worker), message, TaskAck, ANSWER_TIMEOUT_S)
        except (NoRespondersError, TimeoutError):
            return False, f"worker {worker}: no answer (no such worker on {common.namespace}?)"
        if not ack.ok:
            return False, f"worker {worker} refused: {ack.outcome.name} {ack.error}"
        print(f"worker {worker}: changing to {command.role}", flush=True)
        announced.clear()  # a beat from before the change does not count
        try:
            await asyncio.wait_for(announced.wait(), command.wait)
        except TimeoutError:
            return False, f"worker {worker}: no heartbeat as {command.role} in {command.wait} s"
        return True, f"worker {worker} serves {command.role}"
    finally:
        await bus.close()
