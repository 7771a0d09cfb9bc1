"""Ports for a process this one starts, which binds them itself seconds later.

A port found by binding to port 0 comes from the kernel's ephemeral range, the same range
every outgoing connection takes its local port from: between the probe and the child's own
bind, a connection (NATS, ZMQ, HTTP) may take it. A CI run lost a vLLM engine that way (its
NIXL handshake listener's bind refused: address already in use). So the port is drawn at
random below that range and checked to be free now. A port drawn once is never drawn again
by the same process: its child may not have bound it yet (a CI run gave two workers of one
mesh the same metrics port, and the second failed on every restart); nor is a port set
aside, one the process hands a child from its own flags.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000  # below: the well-known and registered ports services tend to sit on
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 64
_drawn: set[int] = set()  # every port this process handed out


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for local ports of outgoing connections (Linux's default
    elsewhere)."""
    try:
        low, high = map(int, _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now, outside the ephemeral range when there is such a
    port (else one the kernel picks), and not handed out by this process before."""
    low, _ = ephemeral_range()
    for _ in range(_TRIES if low > LOWEST else 0):
        port = random.randrange(LOWEST, low)
        if port not in _drawn and _bindable(host, port):
            return _hand_out(port)
    for _ in range(_TRIES):
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _drawn:
            return _hand_out(port)
    raise OSError(f"no free port on {host} that this process has not handed out already")


def set_aside(*ports: int) -> None:
    """Ports this process hands a child without drawing them (its own flags, such as the
    gateway's `up --port`): never drawn for another child, which might bind it first."""
    _drawn.update(ports)


def _hand_out(port: int) -> int:
    _drawn.add(port)
    return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
