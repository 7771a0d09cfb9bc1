"""The embedded nats-server of `splitserve up` admits only its roles, each to exactly the
subjects of DESIGN.md's table (written out again here, independently of the code):
anonymous clients and wrong passwords are refused, every publish and subscription outside
a role's rows is denied, every one inside them is delivered, replies reach the requester."""

from __future__ import annotations

import asyncio
import socket
import stat
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import nats
import pytest

from services.cli import build_parser
from services.launch_cli import config_from_args
from services.launch_plan import LauncherConfig, child_specs
from services.launcher import metrics_ports, run_mesh
from services.supervisor import ChildSpec
from shared.nats_auth import MeshCredentials, mesh_nats_dir, service_role, start_mesh_nats
from shared.nats_options import connect_options
from shared.nats_permissions import may_serve
from shared.ports import free_port
from shared.subjects import Subjects

WORKERS = {"prefill", "decode", "both"}
PREFILLERS = {"prefill", "both"}
DECODERS = {"decode", "both"}
ROLES = ("gateway", "scheduler", "prefill", "decode", "both", "planner", "launcher", "observer")
# DESIGN.md section 3: subject (namespace "ss", ids w1 and g1) → who publishes, who subscribes.
TABLE = {
    "ss.sched.submit": ({"gateway"}, {"scheduler"}),
    "ss.sched.status": ({"gateway", "observer", "planner", "launcher"}, {"scheduler"}),
    "ss.workers.heartbeat": (WORKERS, {"scheduler", "planner"}),
    "ss.kv.events": (WORKERS, {"scheduler"}),
    "ss.worker.w1.reserve": ({"scheduler"}, DECODERS),
    "ss.worker.w1.prefill": ({"scheduler"}, PREFILLERS),
    "ss.worker.w1.decode": ({"scheduler"}, DECODERS),
    "ss.worker.w1.kv": (PREFILLERS, DECODERS),
    "ss.worker.w1.prefix": (WORKERS, WORKERS),  # a prefix read between workers (PrefixPin)
    "ss.worker.w1.role": ({"scheduler", "planner"}, WORKERS),
    "ss.pool.target": ({"planner"}, {"launcher"}),
    "ss.planner.report": ({"planner"}, {"scheduler"}),
    "ss.gateway.g1.tokens": (WORKERS, {"gateway"}),
    "ss.cancel": ({"gateway", "scheduler"}, WORKERS | {"scheduler"}),
    "ss.events": ({"scheduler"}, WORKERS | {"gateway"}),
}
# Never anyone's: another mesh's namespace, everything, another role's reply inbox.
NOBODYS = ("other.sched.submit", ">", "_INBOX.nobody.x")


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    server, credentials = start_mesh_nats(tmp_path_factory.mktemp("nats"), None, Subjects("ss"))
    yield server, credentials
    server.stop()


class Client:
    """One role's connection, with the permission errors the server sent it."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.denied: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, url: str, credentials: MeshCredentials) -> Client:
        async def on_error(exc: Exception) -> None:
            self.denied.append(str(exc).lower())

        options = connect_options(url, credentials.auth(self.role))
        self.nc = await nats.connect(**options, error_cb=on_error, allow_reconnect=False)
        return self

    def was_denied(self, action: str, subject: str) -> bool:
        return any(action in text and f'"{subject.lower()}"' in text for text in self.denied)


async def wait_for_denials(expected: list[tuple[Client, str, str]], timeout: float = 5) -> None:
    """Until each (client, action, subject) was denied. The server may send a `-ERR` after
    the PONG of the flush that followed the offending publish, so a flush does not suffice."""
    deadline = time.monotonic() + timeout
    while not all(client.was_denied(action, subject) for client, action, subject in expected):
        if time.monotonic() > deadline:
            return  # the caller's assertions say which denial is missing
        await asyncio.sleep(0.02)


def test_secrets_are_private_and_anonymous_or_wrong_clients_are_refused(secured):
    server, credentials = secured
    assert stat.S_IMODE(credentials.directory.stat().st_mode) == 0o700
    for path in [*credentials.directory.iterdir(), server.config_path]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

    async def refused(**options) -> None:
        with pytest.raises(Exception, match=r"(?i)authorization|no servers"):
            await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)

    async def main() -> None:
        await refused()
        await refused(user="gateway", password="not-the-password")
        await refused(user="admin", password=credentials.password_file("gateway").read_text())

    asyncio.run(main())


def test_each_role_uses_exactly_its_rows_of_the_subject_table(secured):
    server, credentials = secured

    async def main() -> None:
        clients = {r: await Client(r).connect(server.url, credentials) for r in ROLES}
        received: dict[tuple[str, str], list[bytes]] = {}
        for role, client in clients.items():
            for subject in (*TABLE, *NOBODYS):

                async def on_msg(msg, key=(role, subject)) -> None:
                    received.setdefault(key, []).append(msg.data)

                await client.nc.subscribe(subject, cb=on_msg)
        for client in clients.values():
            await client.nc.flush()
        for role, client in clients.items():
            for subject in (*TABLE, *NOBODYS):
                await client.nc.publish(subject, role.encode())
            await client.nc.flush()
        await wait_for_denials(
            [
                (client, action, subject)
                for role, client in clients.items()
                for subject, (publishers, subscribers) in TABLE.items()
                for action, allowed in (("publish", publishers), ("subscription", subscribers))
                if role not in allowed
            ]
            + [
                (client, action, subject)
                for client in clients.values()
                for subject in NOBODYS
                for action in ("publish", "subscription")
            ]
        )
        await asyncio.sleep(0.3)  # deliveries to other connections, and any stray denial
        for role, client in clients.items():
            for subject, (publishers, subscribers) in TABLE.items():
                denied = client.was_denied("publish", subject)
                assert denied == (role not in publishers), (role, "publish", subject)
                denied = client.was_denied("subscription", subject)
                assert denied == (role not in subscribers), (role, "subscribe", subject)
                got = sorted(received.get((role, subject), []))
                expected = sorted(p.encode() for p in publishers) if role in subscribers else []
                assert got == expected, (role, subject, got)
            for subject in NOBODYS:
                assert client.was_denied("publish", subject), (role, subject)
                assert client.was_denied("subscription", subject), (role, subject)
        for client in clients.values():
            await client.nc.close()

    asyncio.run(main())


def test_requests_get_their_replies_through_the_role_inboxes(secured):
    server, credentials = secured

    async def main() -> None:
        scheduler = await Client("scheduler").connect(server.url, credentials)
        gateway = await Client("gateway").connect(server.url, credentials)
        decode = await Client("decode").connect(server.url, credentials)

        async def answer(msg) -> None:
            await msg.respond(b"ack:" + msg.data)

        await scheduler.nc.subscribe("ss.sched.submit", queue="schedulers", cb=answer)
        await decode.nc.subscribe("ss.worker.w1.reserve", cb=answer)
        await scheduler.nc.flush()
        await decode.nc.flush()
        assert (await gateway.nc.request("ss.sched.submit", b"r1", timeout=2)).data == b"ack:r1"
        reply = await scheduler.nc.request("ss.worker.w1.reserve", b"r2", timeout=2)
        assert reply.data == b"ack:r2"
        # A reply inbox is only its owner's: the decode worker cannot write into the gateway's.
        await decode.nc.publish("_INBOX.gateway.forged", b"x")
        await decode.nc.flush()
        await wait_for_denials([(decode, "publish", "_INBOX.gateway.forged")])
        assert decode.was_denied("publish", "_INBOX.gateway.forged")
        for client in (scheduler, gateway, decode):
            await client.nc.close()

    asyncio.run(main())


def test_a_worker_may_change_to_the_roles_its_nats_user_covers():
    """`both` covers every worker role; `prefill` and `decode` only their own; a user the
    table does not know (anonymous) is not second-guessed."""
    s = Subjects("ss")
    for role in WORKERS:
        assert may_serve("both", role, s) and may_serve("", role, s)
        assert may_serve("prefill", role, s) == (role == "prefill")
        assert may_serve("decode", role, s) == (role == "decode")


def test_credentials_are_fresh_at_every_start_and_each_child_gets_its_role(tmp_path):
    first = MeshCredentials.generate(tmp_path / "auth").password_file("gateway").read_text()
    again = MeshCredentials.generate(tmp_path / "auth")
    assert again.password_file("gateway").read_text() != first
    assert service_role("gateway") == "gateway"
    # Every worker as `both`, whatever its --role: its role is only its initial one, and
    # `splitserve role` (or the planner) may move it to any (`may_serve`).
    assert service_role("worker") == "both"
    assert again.argv("decode") == (
        "--nats-user",
        "decode",
        "--nats-password-file",
        str(tmp_path / "auth" / "decode.password"),
    )


def test_up_starts_its_children_as_their_roles_on_a_server_that_refuses_anonymous(tmp_path):
    stop = threading.Event()
    config = LauncherConfig(home=tmp_path / "home", grace=0.5, ready_timeout=60)
    starts = tmp_path / "starts"
    # A stand-in service: records its pid, then sleeps until SIGTERM.
    script = "import os,sys,time; open(sys.argv[1],'a').write(f'{os.getpid()}\\n'); time.sleep(60)"

    def child(name: str, role: str, *argv: str) -> ChildSpec:
        return ChildSpec(name, role, (sys.executable, "-c", script, str(starts), *argv))

    children = [
        child("sched", "scheduler"),
        child("decode-0", "worker", "--role", "decode"),
        child("gw", "gateway"),
    ]
    runner = threading.Thread(target=run_mesh, args=(config, stop, lambda url: children, bool))
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while len(starts.read_text().split() if starts.exists() else []) < 3:
            assert time.monotonic() < deadline, "children did not start"
            time.sleep(0.05)
        pids = starts.read_text().split()
        argvs = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in pids]
        users = sorted(a[a.index(b"--nats-user") + 1].decode() for a in argvs)
        assert users == ["both", "gateway", "scheduler"]  # the decode worker as `both`
        nats_dir = mesh_nats_dir(config.home, config.port)
        credentials = MeshCredentials(nats_dir / "auth")
        url = f"nats://127.0.0.1:{_port(nats_dir / 'nats.conf')}"

        async def main() -> None:
            nc = await nats.connect(**connect_options(url, credentials.auth("both")))
            await nc.close()
            with pytest.raises(Exception, match=r"(?i)authorization|no servers"):
                await nats.connect(url, allow_reconnect=False, connect_timeout=2)

        asyncio.run(main())
    finally:
        stop.set()
        runner.join(20)
    assert not runner.is_alive()


def _port(config: Path) -> int:
    return int(config.read_text().split("listen: 127.0.0.1:", 1)[1].split()[0])


def _listening(config: Path) -> bool:
    """Has the nats-server of `config` (written just before it starts) begun to listen?"""
    try:
        socket.create_connection(("127.0.0.1", _port(config)), timeout=0.2).close()
    except (OSError, IndexError, ValueError):
        return False
    return True


def test_up_with_an_external_server_passes_its_credentials_and_tls_to_every_service(tmp_path):
    argv = ["up", "--nats", "nats://a:4222,nats://b:4222", "--nats-user", "mesh"]
    argv += ["--nats-password-file", str(tmp_path / "pw"), "--nats-tls-ca", str(tmp_path / "ca")]
    config = config_from_args(build_parser().parse_args(argv), tmp_path)
    config = replace(config, model_dir=tmp_path)
    specs = child_specs(config, config.nats_url, metrics_ports(config))
    assert len(specs) == 4  # scheduler, prefill, decode, gateway
    for spec in specs:
        line = " ".join(spec.argv)
        assert "--nats nats://a:4222,nats://b:4222" in line
        assert "--nats-user mesh" in line
        assert f"--nats-tls-ca {tmp_path / 'ca'}" in line


def test_two_meshes_on_one_home_keep_their_own_credentials_and_leave_nothing(tmp_path):
    """Two `up`s with the same SPLITSERVE_HOME (issue 60): each has its own nats-server
    directory, so the second's start does not rewrite the first's passwords: both servers
    admit their own credentials while both run, and each directory is removed at stop."""
    home = tmp_path / "home"
    script = "import time; time.sleep(60)"
    children = [ChildSpec("sched", "scheduler", (sys.executable, "-c", script))]
    meshes = []
    for _ in range(2):
        config = LauncherConfig(home=home, port=free_port(), grace=0.5, ready_timeout=60)
        stop = threading.Event()
        runner = threading.Thread(target=run_mesh, args=(config, stop, lambda url: children, bool))
        runner.start()
        meshes.append((config, stop, runner))
    try:
        dirs = [mesh_nats_dir(config.home, config.port) for config, _, _ in meshes]
        deadline = time.monotonic() + 20
        while not all(_listening(d / "nats.conf") for d in dirs):
            assert time.monotonic() < deadline, "a mesh's nats-server did not start"
            time.sleep(0.05)
        assert dirs[0] != dirs[1]

        async def main() -> None:
            for nats_dir in dirs:
                url = f"nats://127.0.0.1:{_port(nats_dir / 'nats.conf')}"
                auth = MeshCredentials(nats_dir / "auth").auth("observer")
                nc = await nats.connect(**connect_options(url, auth), allow_reconnect=False)
                await nc.close()

        asyncio.run(main())
    finally:
        for _, stop, _ in meshes:
            stop.set()
        for _, _, runner in meshes:
            runner.join(20)
    assert not any(runner.is_alive() for _, _, runner in meshes)
    assert not any(d.exists() for d in dirs)
