"""`splitserve up` supervision with stand-in children (small Python scripts): crashed
children restart up to the per-minute limit, shutdown goes gateway → workers → scheduler →
nats-server (killing what ignores SIGTERM), and the readiness probe has a deadline."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from services import launch_cli, launcher
from services.cli import build_parser
from services.launch_plan import LauncherConfig, child_specs
from services.launcher import metrics_ports, run_mesh
from services.supervisor import ChildSpec, MeshDown, Supervisor
from services.worker import cli as worker_cli
from services.worker.cli import engine_argv
from shared.ports import free_port

# A stand-in service: records its start (name pid), and on SIGTERM records its stop. Its
# handlers are in place before it records its start: a SIGTERM that follows at once (a loaded
# machine, the last child started) is then a stop recorded, not a death by the default action.
STAND_IN = """
import faulthandler, os, signal, sys, time
name, starts, stops, mode = sys.argv[1:5]
stacks = open(stops + "." + name.replace("/", "_") + ".stacks", "w")  # a name may be a URL
faulthandler.register(signal.SIGUSR1, file=stacks)  # as service_loop.run does (to stderr)
def bye(*_):
    with open(stops, "a") as f:
        f.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else bye)
with open(starts, "a") as f:
    f.write(f"{name} {os.getpid()}\\n")
if mode == "crash":
    time.sleep(0.1)
    sys.exit(3)
while True:
    time.sleep(0.02)
"""


def stand_in(tmp: Path, name: str, role: str, mode: str = "serve") -> ChildSpec:
    argv = (sys.executable, "-c", STAND_IN, name, str(tmp / "starts"), str(tmp / "stops"), mode)
    return ChildSpec(name, role, argv)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def assert_closed(port: int) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_restart_limit_ordered_shutdown_and_ready_deadline(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="services")  # launcher and supervisor
    nats_port = free_port()
    config = LauncherConfig(
        home=tmp_path / "home",
        nats_port=nats_port,
        ready_timeout=3.0,  # past the crashing child's last restart
        grace=0.5,
        restart_backoff=0.05,
        max_restarts_per_minute=2,
    )
    seen_urls: list[str] = []

    def children(nats_url: str) -> list[ChildSpec]:
        seen_urls.append(nats_url)
        return [
            stand_in(tmp_path, "sched", "scheduler"),
            stand_in(tmp_path, "stubborn", "worker", "stubborn"),
            stand_in(tmp_path, "crashy", "worker", "crash"),
            stand_in(tmp_path, "gw", "gateway"),
        ]

    stop = threading.Event()
    runner = threading.Thread(target=run_mesh, args=(config, stop, children, lambda: False))
    runner.start()
    try:
        wait_for(lambda: "giving up on it" in caplog.text)
        wait_for(lambda: "gateway not ready after 3s" in caplog.text)
        assert "children not running: crashy;" in caplog.text
        socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
    finally:
        stop.set()
        runner.join(20)
    assert not runner.is_alive()
    starts = [line.split()[0] for line in lines(tmp_path / "starts")]
    assert starts.count("crashy") == 3  # first start + 2 restarts
    assert starts.count("sched") == starts.count("gw") == 1
    assert lines(tmp_path / "stops") == ["gw", "sched"]  # stubborn worker was killed between
    assert "stubborn ignored SIGTERM" in caplog.text
    # Before the SIGKILL, the hung child was asked for its stacks: they show where it hung.
    assert "in <module>" in (tmp_path / "stops.stubborn.stacks").read_text()
    assert seen_urls == [f"nats://127.0.0.1:{nats_port}"]
    assert_closed(nats_port)  # nats-server stopped


def test_a_gateway_that_keeps_crashing_stops_the_mesh(tmp_path):
    nats_port = free_port()
    config = LauncherConfig(
        home=tmp_path / "home",
        nats_port=nats_port,
        grace=0.5,
        restart_backoff=0.05,
        max_restarts_per_minute=2,
    )

    def children(nats_url: str) -> list[ChildSpec]:
        return [
            stand_in(tmp_path, "sched", "scheduler"),
            stand_in(tmp_path, "w", "worker"),
            stand_in(tmp_path, "gw", "gateway", "crash"),
        ]

    assert "gave up on gw" in str(mesh_down(config, children, timeout=20))
    assert [line.split()[0] for line in lines(tmp_path / "starts")].count("gw") == 3
    assert lines(tmp_path / "stops") == ["w", "sched"]  # the rest stopped, in order
    assert_closed(nats_port)  # nats-server stopped


def test_up_refuses_a_taken_gateway_port_before_starting_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "in use" in launcher.gateway_port_problem("127.0.0.1", port)
        args = build_parser().parse_args(["up", "--port", str(port), "--model-dir", "/none"])
        try:
            args.func(args)
            raise AssertionError("up started")
        except SystemExit as exc:
            assert f"cannot listen on 127.0.0.1:{port} (Address already in use)" in str(exc)
    assert launcher.gateway_port_problem("127.0.0.1", port) is None  # free again
    assert "does not resolve" in launcher.gateway_port_problem("no-such-host.invalid", port)


def test_external_nats_and_ready_banner(tmp_path, capsys, nats_server):
    config = LauncherConfig(home=tmp_path, nats_url=nats_server.url, port=8123)
    probes = iter([False, True])
    stop = threading.Event()
    runner = threading.Thread(
        target=run_mesh,
        args=(config, stop, lambda url: [stand_in(tmp_path, url, "gateway")], probes.__next__),
    )
    runner.start()
    try:
        wait_for(lambda: "splitserve is up" in capsys.readouterr().out)
    finally:
        stop.set()
        runner.join(20)
    assert lines(tmp_path / "starts")[0].startswith(nats_server.url)
    assert not (tmp_path / "nats").exists()  # no embedded server


def test_command_table():
    config = LauncherConfig(
        home=Path("/h"), model_dir=Path("/m"), prefill=2, decode=1, metrics_port=9100
    )
    specs = child_specs(config, "nats://x:1", metrics_ports(config))
    assert [s.name for s in specs] == [
        "scheduler",
        "worker prefill-0",
        "worker prefill-1",
        "worker decode-0",
        "gateway",
    ]
    assert specs[1].argv[3:] == (
        "worker",
        *("--role", "prefill", "--model-dir", "/m", "--worker-id", "prefill-0"),
        *("--nats", "nats://x:1", "--namespace", "ss"),
        *("--metrics-port", "9101"),  # the scheduler has 9100
    )
    assert specs[-1].argv[3:9] == (
        "gateway",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--model-dir",
    )
    aggregated = LauncherConfig(home=Path("/h"), model_dir=Path("/m"), prefill=3, aggregated=True)
    roles = [
        s.argv[5]
        for s in child_specs(aggregated, "u", metrics_ports(aggregated))
        if s.role == "worker"
    ]
    assert roles == ["both", "both", "both"]


def test_engine_flags_of_up_reach_every_worker_and_parse_there():
    """`splitserve up --quantization int8 --speculative ngram ...` hands the engine flags
    that differ from their defaults to each worker, whose own parser takes them."""
    parser = argparse.ArgumentParser()
    launch_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["up", "--quantization", "int8", "--speculative", "ngram", "--no-batch-invariant"]
    )
    config = LauncherConfig(home=Path("/h"), model_dir=Path("/m"), worker_args=engine_argv(args))
    workers = [
        s for s in child_specs(config, "nats://x:1", metrics_ports(config)) if s.role == "worker"
    ]
    assert len(workers) == 2
    worker_parser = argparse.ArgumentParser()
    worker_cli.add_arguments(worker_parser)
    for spec in workers:
        parsed = worker_parser.parse_args(spec.argv[4:])
        assert (parsed.quantization, parsed.speculative) == ("int8", "ngram")
        assert parsed.batch_invariant is False and parsed.max_num_seqs == 64
    assert engine_argv(parser.parse_args(["up"])) == ()


def test_up_pulls_a_float_copy_only_where_the_workers_need_one():
    """A known model is pulled kept quantized (or whichever copy is there) unless the
    workers cannot serve it so: vLLM, a GPU, our own --quantization."""
    parser = build_parser()
    assert launch_cli.keep_quant(parser.parse_args(["up", "--device", "cpu"])) is None
    for flags in (["--engine", "vllm"], ["--quantization", "int4"], ["--device", "cuda:0"]):
        assert launch_cli.keep_quant(parser.parse_args(["up", *flags])) is False, flags


def up_children(argv: list[str]) -> dict[str, argparse.Namespace]:
    """Each child of `splitserve up ARGV` (model dir /m), parsed by the real `splitserve`:
    a flag forwarded to a service that lacks it would fail here."""
    args = build_parser().parse_args(["up", "--model-dir", "/m", *argv])
    config = launch_cli.config_from_args(args, Path("/h"))
    specs = child_specs(config, "nats://x:1", metrics_ports(config))
    return {spec.name: build_parser().parse_args(spec.argv[3:]) for spec in specs}


def test_gateway_and_scheduler_flags_of_up_reach_them():
    children = up_children(
        ["--cors-origins", "*", "--api-key", "k1", "--api-key", "k2", "--max-queue", "9"]
    )
    gateway = children["gateway"]
    assert (gateway.cors_origins, gateway.api_keys) == (("*",), ("k1", "k2"))
    assert children["scheduler"].max_queue == 9
    defaults = up_children([])
    assert defaults["gateway"].cors_origins == () and defaults["scheduler"].max_queue == 256


def test_a_flag_of_workers_and_another_service_reaches_both():
    """--max-model-len binds workers and the gateway, --block-size workers and the scheduler:
    one flag of `up`, given to each."""
    children = up_children(["--max-model-len", "512", "--block-size", "32"])
    workers = [args for name, args in children.items() if name.startswith("worker")]
    assert [(w.max_model_len, w.block_size) for w in workers] == [(512, 32), (512, 32)]
    assert children["gateway"].max_model_len == 512
    assert children["scheduler"].block_size == 32


def test_up_sets_the_gateway_address_itself():
    children = up_children(["--host", "0.0.0.0", "--port", "9000"])
    gateway = children["gateway"]
    assert (gateway.host, gateway.port, gateway.model_dir) == ("0.0.0.0", 9000, Path("/m"))


# A child that starts a process of its own, then exits after argv[2] seconds (or on SIGTERM)
# without it, as a killed or stopped vLLM worker leaves its engine core: the grandchild's
# pid goes to the file argv[1].
LEAVES_A_GRANDCHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(float(sys.argv[2]))
sys.exit(9)
"""


def _supervised_grandchild(tmp_path: Path, lives_s: float) -> tuple[Supervisor, int]:
    """A supervisor running one such child, and the grandchild's pid once written."""
    pid_file = tmp_path / "grandchild"
    argv = (sys.executable, "-c", LEAVES_A_GRANDCHILD, str(pid_file), str(lives_s))
    spec = ChildSpec("worker w", "worker", argv)
    supervisor = Supervisor([spec], restart_backoff=60, max_restarts_per_minute=5, grace=1)
    supervisor.start_all()
    wait_for(pid_file.exists)
    return supervisor, int(pid_file.read_text())


def test_a_dead_childs_leftover_processes_are_killed_before_its_restart(tmp_path):
    supervisor, grandchild = _supervised_grandchild(tmp_path, 0.2)
    child = supervisor.children[0]
    wait_for(lambda: child.process.poll() is not None)
    assert Path(f"/proc/{grandchild}").exists()
    supervisor.poll()  # notices the death, schedules the restart
    wait_for(lambda: _gone(grandchild))


def test_a_stopped_childs_leftover_processes_are_killed(tmp_path):
    supervisor, grandchild = _supervised_grandchild(tmp_path, 60)
    supervisor.stop_all()
    wait_for(lambda: _gone(grandchild))


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_of_another_role_stops_first(tmp_path):
    """A child outside STOP_ORDER (a planner) stops before the gateway, so it changes
    nothing while the mesh goes down."""
    specs = [stand_in(tmp_path, name, role) for name, role in [
        ("sched", "scheduler"), ("w", "worker"), ("gw", "gateway"), ("plan", "planner")
    ]]  # fmt: skip
    supervisor = Supervisor(specs, 0.05, 2, 2.0)
    supervisor.start_all()
    wait_for(lambda: len(lines(tmp_path / "starts")) == 4)
    supervisor.stop_all()
    assert lines(tmp_path / "stops") == ["plan", "gw", "w", "sched"]


def mesh_down(config: LauncherConfig, children: list[ChildSpec], timeout: float) -> MeshDown:
    """Run the mesh of `children` in a thread until it stops by itself (never stopped from
    outside) within `timeout` seconds; the MeshDown it stopped with."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            run_mesh(config, threading.Event(), children, lambda: False)
        except BaseException as exc:  # handed to the test's thread
            failures.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    runner.join(timeout)
    assert not runner.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], MeshDown)
    return failures[0]
