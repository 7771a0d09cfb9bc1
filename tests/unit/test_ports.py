"""Ports for child processes: free when drawn, and below the kernel's ephemeral range, where no
outgoing connection takes its local port from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shared import ports


def free_now(count: int) -> list[int]:
    """`count` distinct ports, each free again once this returns."""
    probes = [socket.socket() for _ in range(count)]
    for probe in probes:
        probe.bind(("127.0.0.1", 0))
    found = [probe.getsockname()[1] for probe in probes]
    for probe in probes:
        probe.close()
    return found


def draw_in_order(monkeypatch, draws: list[int]) -> None:
    """The random draws below the ephemeral range come out as `draws`, in order, to a
    process that has handed out nothing yet."""
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (60999, 61000))
    monkeypatch.setattr(ports, "_drawn", set())
    order = iter(draws)
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(order))


def test_a_drawn_port_is_free_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    if low <= ports.LOWEST:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: binds


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        (other,) = free_now(1)  # not `held`'s: that one is bound
        draw_in_order(monkeypatch, [held.getsockname()[1], other])
        assert ports.free_port() == other


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST, 60999))
    port = ports.free_port()
    assert port > 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("40000\t50000\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    assert ports.ephemeral_range() == (40000, 50000)
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_range() == (32768, 60999)


def test_a_port_is_handed_out_once_per_process(monkeypatch):
    # a child may not have bound its port yet when the next is drawn: the same draw again
    # (as two workers of one CI mesh once got) must pass it over
    first, second = free_now(2)
    draw_in_order(monkeypatch, [first, first, first, second])
    assert ports.free_port() == first
    assert ports.free_port() == second  # `first` is still free, but handed out


def test_the_kernel_s_pick_is_handed_out_once_too(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST, 60999))
    monkeypatch.setattr(ports, "_drawn", set())
    drawn = {ports.free_port() for _ in range(50)}
    assert len(drawn) == 50


def test_a_port_set_aside_is_never_drawn(monkeypatch):
    gateway, other = free_now(2)
    draw_in_order(monkeypatch, [gateway, other])
    ports.set_aside(gateway)
    assert ports.free_port() == other  # `gateway` is free, but a child will bind it


def test_up_never_gives_a_metrics_port_the_gateway_s(monkeypatch):
    from services.launch_plan import LauncherConfig, child_specs
    from services.launcher import metrics_ports

    gateway, *others = free_now(4)
    draw_in_order(monkeypatch, [x for other in others for x in (gateway, other)])
    config = LauncherConfig(home=Path("/h"), model_dir=Path("/m"), port=gateway)
    specs = child_specs(config, "nats://x:1", metrics_ports(config))
    metrics = [
        int(s.argv[s.argv.index("--metrics-port") + 1]) for s in specs if s.role != "gateway"
    ]
    assert sorted(metrics) == sorted(others)  # scheduler, prefill and decode worker
