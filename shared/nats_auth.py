"""Fresh NATS credentials for a mesh, and the server config that admits only them.

`MeshCredentials.generate(directory)` makes one random password per role (ROLES of
shared/nats_permissions.py) in a private directory (0700, files 0600, replaced at every
start), `server_config(subjects)` writes the nats-server `authorization` block granting
each role exactly its permissions (no anonymous user: a client without credentials is
refused), and `argv(role)` is what a service of that role adds to its command line:
`--nats-user ROLE --nats-password-file FILE` (the password never appears in a process list).

`start_mesh_nats` starts `splitserve up`'s nats-server so; `service_role(spec_role)` names
the NATS role of one of its children: its service's, or `both` for every worker. A worker's
role is only its initial one (`splitserve role`, the planner and PoolTargets change it
while it serves), and its NATS user must cover every role it may take (`may_serve`); the
gateway and the scheduler keep their least-privileged users.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.nats_options import NatsAuth
from shared.nats_permissions import ROLES, role_permissions
from shared.nats_server import NatsServer, start_nats_server, write_private
from shared.subjects import Subjects

PASSWORD_BYTES = 24


@dataclass(frozen=True, slots=True)
class MeshCredentials:
    directory: Path  # <role>.password files, 0600, in a 0700 directory

    @classmethod
    def generate(cls, directory: Path) -> MeshCredentials:
        """New passwords for every role; whatever `directory` held before is removed."""
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True, mode=0o700)
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
        for role in ROLES:
            write_private(directory / f"{role}.password", secrets.token_urlsafe(PASSWORD_BYTES))
        return cls(directory)

    def password_file(self, role: str) -> Path:
        return self.directory / f"{role}.password"

    def auth(self, role: str) -> NatsAuth:
        return NatsAuth(nats_user=role, nats_password_file=self.password_file(role))

    def argv(self, role: str) -> tuple[str, ...]:
        return ("--nats-user", role, "--nats-password-file", str(self.password_file(role)))

    def server_config(self, subjects: Subjects) -> str:
        """The nats-server `authorization` block: one user per role, nobody else."""

        def password(role: str) -> str:
            return json.dumps(self.password_file(role).read_text(encoding="utf-8"))

        return authorization_block(subjects, password)


def authorization_block(subjects: Subjects, password: Callable[[str], str]) -> str:
    """nats-server config granting each role (user = role name) its permissions; `password`
    gives each role's password as config text: a quoted string, or `$VARIABLE` (compose
    and k8s read them from their Secrets: compose/nats/nats.conf)."""
    users = []
    for role in ROLES:
        allowed = role_permissions(role, subjects)
        permissions = (
            f"publish: {{allow: {json.dumps(list(allowed.publish))}}}, "
            f"subscribe: {{allow: {json.dumps(list(allowed.subscribe))}}}, allow_responses: true"
        )
        users.append(
            f"    {{user: {role}, password: {password(role)},\n"
            f"     permissions: {{{permissions}}}}}"
        )
    return "authorization {\n  users = [\n" + ",\n".join(users) + "\n  ]\n}\n"


def password_variable(role: str) -> str:
    """The environment variable a static nats.conf reads `role`'s password from."""
    return f"$NATS_{role.upper()}_PASSWORD"


def mesh_nats_dir(home: Path, gateway_port: int) -> Path:
    """Where `splitserve up` with its gateway on `gateway_port` keeps its nats-server's config,
    log, JetStream store and credentials (`auth/`): one directory per mesh (no two meshes on
    a machine share a gateway port), so a second `up` never rewrites a first one's passwords;
    `up` removes it at shutdown."""
    return home / "nats" / f"mesh-{gateway_port}"


def start_mesh_nats(
    data_dir: Path, port: int | None, subjects: Subjects
) -> tuple[NatsServer, MeshCredentials]:
    """`splitserve up`'s own nats-server, admitting only the fresh credentials it returns
    (under `data_dir`/auth)."""
    credentials = MeshCredentials.generate(data_dir / "auth")
    server = start_nats_server(data_dir, port, extra_config=credentials.server_config(subjects))
    return server, credentials


def service_role(spec_role: str) -> str:
    """The NATS role of a child: its service's ("gateway", "scheduler", ...), or "both" for
    a worker, whatever its initial `--role`: it may be told to serve any."""
    return "both" if spec_role == "worker" else spec_role
