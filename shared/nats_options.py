"""How a service proves who it is to NATS and checks who NATS is: credentials and TLS.

`NatsAuth` holds the `--nats-*` flags every service takes (each with its `SPLITSERVE_NATS_*`
variable): a user and password (the password from the variable, or a file such as a mounted
Secret, so it never shows in a process list), and TLS: a CA that verifies the server and,
when the server asks for one, a client certificate. `connect_options` turns it and the
`--nats` URL list (comma-separated: a cluster's nodes) into nats-py's `connect` arguments.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.flags import flag

INBOX_ROOT = "_INBOX"  # a user's replies come back under _INBOX.<user>.>


class NatsAuthError(ConfigError):
    """Credentials or TLS settings that cannot work (a key without its certificate, ...)."""


@dataclass(frozen=True, slots=True)
class NatsAuth:
    nats_user: str = flag("", help="NATS user: the service's role identity; '': anonymous")
    nats_password: str = flag("", help="NATS password (prefer the variable or a file)")
    nats_password_file: Path | None = flag(None, help="file holding the NATS password")
    nats_tls_ca: Path | None = flag(None, help="CA bundle verifying the NATS server (TLS on)")
    nats_tls_cert: Path | None = flag(None, help="client certificate for NATS (mutual TLS)")
    nats_tls_key: Path | None = flag(None, help="the client certificate's private key")

    def __post_init__(self) -> None:
        if self.nats_password and self.nats_password_file:
            raise NatsAuthError("give --nats-password or --nats-password-file, not both")
        if (self.nats_password or self.nats_password_file) and not self.nats_user:
            raise NatsAuthError("a NATS password needs --nats-user")
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise NatsAuthError("--nats-tls-cert and --nats-tls-key go together")

    @property
    def tls(self) -> bool:
        return self.nats_tls_ca is not None or self.nats_tls_cert is not None

    def password(self) -> str:
        if self.nats_password_file is None:
            return self.nats_password
        try:
            return self.nats_password_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise NatsAuthError(f"--nats-password-file: {exc}") from None

    def ssl_context(self) -> ssl.SSLContext:
        """Verifies the server against `nats_tls_ca` (or the system's CAs) and its name."""
        context = ssl.create_default_context(
            cafile=str(self.nats_tls_ca) if self.nats_tls_ca else None
        )
        if self.nats_tls_cert is not None and self.nats_tls_key is not None:
            context.load_cert_chain(str(self.nats_tls_cert), str(self.nats_tls_key))
        return context


def server_urls(urls: str) -> list[str]:
    """`nats://a:4222,nats://b:4222` → one URL per cluster node; `tls://` where TLS is on."""
    found = [url.strip() for url in urls.split(",") if url.strip()]
    if not found:
        raise NatsAuthError("no NATS URL given")
    return found


def connect_options(urls: str, auth: NatsAuth) -> dict[str, Any]:
    """The `nats.connect` keyword arguments for `urls` and `auth`."""
    options: dict[str, Any] = {"servers": server_urls(urls)}
    if auth.nats_user:
        options |= {"user": auth.nats_user, "password": auth.password()}
        # The role may subscribe to its own inbox tree only (shared/nats_permissions.py).
        options["inbox_prefix"] = f"{INBOX_ROOT}.{auth.nats_user}"
    if auth.tls:
        options["tls"] = auth.ssl_context()
    return options
