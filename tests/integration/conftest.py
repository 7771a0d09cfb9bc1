"""Fixtures for tests over a real nats-server: each test module gets its own server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.nats_server import NatsServer, start_nats_server


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = start_nats_server(tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()
