"""NATS over TLS (certificates made here with the openssl CLI): a service verifies the
server against its CA, and with `verify` on the server admits only clients with a
certificate of that CA. A wrong CA, a missing client certificate and a plaintext client
are all refused."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from shared.bus import Bus
from shared.nats_options import NatsAuth
from shared.nats_server import start_nats_server
from shared.protocol import Cancel

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            f"/CN={name}", "-keyout", str(key), "-out", str(cert))  # fmt: skip
    return cert, key


def make_cert(directory: Path, name: str, ca: tuple[Path, Path], san: str) -> tuple[Path, Path]:
    """A certificate for `name` signed by `ca`, valid for `san` (e.g. IP:127.0.0.1)."""
    cert, key, request = (directory / f"{name}{s}.pem" for s in ("", "-key", "-req"))
    extensions = directory / f"{name}.ext"
    extensions.write_text(f"subjectAltName={san}\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(key), "-out", str(request))  # fmt: skip
    sign = ("-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial", "-days", "2")
    openssl("x509", "-req", "-in", str(request), *sign, "-extfile", str(extensions),
            "-out", str(cert))  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    certs = tmp_path_factory.mktemp("certs")
    ca = make_ca(certs, "ca")
    other_ca = make_ca(certs, "other-ca")
    server_cert = make_cert(certs, "server", ca, "IP:127.0.0.1,DNS:localhost")
    client_cert = make_cert(certs, "client", ca, "DNS:gateway")
    block = {
        "cert_file": str(server_cert[0]),
        "key_file": str(server_cert[1]),
        "ca_file": str(ca[0]),
        "verify": True,  # clients need a certificate of our CA
        "timeout": 2,
    }
    server = start_nats_server(
        tmp_path_factory.mktemp("nats-tls"), extra_config=f"tls {json.dumps(block)}\n"
    )
    yield server, ca[0], other_ca[0], client_cert
    server.stop()


def connects(url: str, auth: NatsAuth | None) -> bool:
    async def main() -> bool:
        try:
            bus = await Bus.connect(url, "tls-test", connect_timeout=1.5, auth=auth)
        except ConnectionError:
            return False
        got = asyncio.get_running_loop().create_future()

        async def on_cancel(cancel: Cancel, headers) -> None:
            got.set_result(cancel.request_id)

        await bus.subscribe("t.tls", Cancel, on_cancel)
        await bus.nc.flush()
        await bus.publish("t.tls", Cancel("over-tls"))
        assert await asyncio.wait_for(got, 5) == "over-tls"
        await bus.close()
        return True

    return asyncio.run(main())


def test_mutual_tls_admits_only_verified_clients_of_a_verified_server(tls) -> None:
    server, ca, other_ca, (cert, key) = tls
    assert connects(server.url, NatsAuth(nats_tls_ca=ca, nats_tls_cert=cert, nats_tls_key=key))
    assert not connects(server.url, NatsAuth(nats_tls_ca=ca))  # no client certificate
    wrong_ca = NatsAuth(nats_tls_ca=other_ca, nats_tls_cert=cert, nats_tls_key=key)
    assert not connects(server.url, wrong_ca)  # the server's certificate is not trusted
    assert not connects(server.url, None)  # plaintext


def test_a_certificate_needs_its_key() -> None:
    with pytest.raises(ValueError, match="go together"):
        NatsAuth(nats_tls_cert=Path("client.pem"))
