"""ConfigError: a setting that cannot run is told apart from a bug, and is still a ValueError;
each service's config raises it, and the CLIs show it (and only it) as a usage error."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loadtest.mesh_bench.burst import MeshBurstConfig
from loadtest.peers.config import PeersConfig
from loadtest.peers.offline import OfflineConfig
from services.cannot_run import CANNOT_RUN
from services.cli import build_parser
from services.gateway.config import GatewayConfig
from services.launch_plan import LauncherConfig
from services.scheduler.config import SchedulerConfig
from services.worker import cli as worker_cli
from services.worker.config import WorkerConfig
from shared.config import CommonConfig
from shared.engine.attention import get_backend
from shared.engine.engine_config import EngineConfig
from shared.engine.model_config import UnsupportedArchitecture
from shared.errors import ConfigError
from shared.flags import settings
from shared.kvtransfer.chunks import KVLayout
from shared.kvtransfer.select import make_transport
from shared.nats_options import NatsAuth

ENGINE = EngineConfig(model_dir=Path("/m"))
WORKER = {"worker_id": "w", "role": "both", "model_name": "m", "engine": ENGINE}


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(UnsupportedArchitecture, ConfigError)


def test_unknown_attention_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="attention backend 'nope' is not available"):
        get_backend("nope")


def test_unknown_kv_transport_is_a_config_error() -> None:
    layout = KVLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=8, dtype="float32")
    with pytest.raises(ConfigError, match="KV transport must be one of"):
        make_transport("agent", [], layout, "carrier-pigeon")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GatewayConfig(CommonConfig(), Path("/m"), "m", "gw", 1), "max_model_len"),
        (lambda: SchedulerConfig(max_queue=0), "max_queue must be >= 1"),
        (lambda: SchedulerConfig(block_size=12), "block_size must be a power of two"),
        (lambda: WorkerConfig(**WORKER | {"role": "router"}), "role must be one of"),
        (lambda: WorkerConfig(**WORKER | {"engine_kind": "vllm", "kv_transport": "nats"}), "NIXL"),
        (lambda: EngineConfig(model_dir=Path("/m"), device="tpu"), "device must be auto"),
        (lambda: LauncherConfig(home=Path("/h"), decode=0), "at least one decode worker"),
        (lambda: NatsAuth(nats_password="secret"), "needs --nats-user"),
        (lambda: PeersConfig(servers=("splitserve", "tgi")), "unknown server 'tgi'"),
        (lambda: OfflineConfig(repeats=0), "at least 1"),
        (lambda: MeshBurstConfig(Path("/m"), output_len=1), "output_len > 1"),
    ],
)
def test_each_config_refuses_a_bad_setting_with_a_config_error(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_flag_value_that_does_not_parse_is_a_config_error():
    by_name = {s.name: s for s in settings(EngineConfig)}
    with pytest.raises(ConfigError, match="invalid literal for int"):
        by_name["max_num_seqs"].parse("many")
    with pytest.raises(ConfigError, match="expected one of"):
        by_name["enable_prefix_caching"].parse("maybe")
    with pytest.raises(ConfigError, match="expected one of"):
        by_name["dtype"].parse("fp8")


def test_the_worker_cli_exits_on_a_config_error_but_not_on_a_bug(monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    args = parser.parse_args(["--model-dir", "/m", "--num-kv-blocks", "0"])
    with pytest.raises(SystemExit) as exited:
        worker_cli.main(args)
    assert exited.value.code == CANNOT_RUN  # `up` stops rather than restart it
    refusal = capsys.readouterr().err
    assert "splitserve worker: cannot run: num_kv_blocks must be positive" in refusal

    def bug(_: argparse.Namespace) -> WorkerConfig:
        raise ValueError("a bug")

    monkeypatch.setattr(worker_cli, "config_from_args", bug)
    with pytest.raises(ValueError, match="a bug"):  # a traceback, not a usage error
        worker_cli.main(args)


def test_up_and_bench_peers_exit_with_a_config_errors_reason():
    up = build_parser().parse_args(["up", "--decode", "0", "--model-dir", "/none"])
    with pytest.raises(SystemExit, match="splitserve up: a disaggregated mesh needs"):
        up.func(up)
    peers = build_parser().parse_args(["bench", "peers", "--concurrency", "1,many"])
    with pytest.raises(SystemExit, match="--concurrency '1,many': invalid literal"):
        peers.func(peers)
