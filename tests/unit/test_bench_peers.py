"""`splitserve bench peers` without any server: the turn plan, figures, ratios, commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.metrics import summarize
from loadtest.peers import prepare
from loadtest.peers.config import PeersConfig
from loadtest.peers.figures import (
    RunFigures,
    Turn,
    format_summary,
    headlines,
    medians,
    plan_turns,
    ratios,
)
from loadtest.peers.offline import OfflineResult
from loadtest.peers.run import _server_figures, word_requests
from loadtest.peers.servers import (
    PeerProcess,
    ServerCommand,
    cpu_ranges,
    llama_server_command,
    vllm_command,
    vllm_env,
    vllm_mesh_args,
)
from loadtest.request import RequestRecord
from services.cli import build_parser


def test_turns_alternate_servers_round_after_round():
    turns = plan_turns(("splitserve", "vllm"), 2)
    assert turns == [
        Turn(1, "splitserve"), Turn(1, "vllm"), Turn(2, "splitserve"), Turn(2, "vllm")
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("servers", "rounds", "message"),
    [
        (("splitserve", "sglang"), 1, "unknown server 'sglang'"),
        (("vllm", "vllm"), 1, "named twice"),
        ((), 1, "no server"),
        (("vllm",), 0, "rounds"),
    ],
)
def test_bad_plans_are_refused(servers, rounds, message):
    with pytest.raises(ValueError, match=message):
        plan_turns(servers, rounds)


def test_config_checks_its_plan_and_sizes_runs():
    with pytest.raises(ValueError, match="unknown server"):
        PeersConfig(servers=("splitserve", "tgi"))
    with pytest.raises(ValueError, match="concurrencies"):
        PeersConfig(concurrencies=(0, 16))
    cfg = PeersConfig()
    assert (cfg.prompts_at(1), cfg.prompts_at(16)) == (8, 64)
    assert PeersConfig(num_prompts=3).prompts_at(16) == 3


def _figures(server, rnd, conc, tok_s, ttft_p99, tpot, ttft, completed=8):
    return RunFigures(server, rnd, conc, completed, 0, tok_s, ttft, ttft_p99, tpot)


def test_a_servers_machine_figures_are_its_medians_and_mean_request_size():
    runs = [
        RunFigures("splitserve", 1, 1, 8, 0, 20.0, 90.0, 95.0, 15.0, 1000, 1024),
        RunFigures("splitserve", 1, 16, 64, 0, 300.0, 800.0, 1500.0, 40.0, 8000, 8192),
        RunFigures("vllm", 1, 16, 64, 0, 250.0, 900.0, 1000.0, 45.0, 8064, 8192),
    ]
    marks = headlines((1, 16))
    by_server = medians(runs, marks)
    offline = OfflineResult(ours_runs=(450.0, 430.0), vllm_runs=(470.0,))
    ours = _server_figures(
        "splitserve", runs, by_server["splitserve"], marks, PeersConfig(), offline
    )
    assert (ours.output_tok_s, ours.tpot_ms, ours.offline_tok_s) == (300.0, 15.0, 450.0)
    assert (ours.prompt_len, ours.output_len) == (9000 / 72, 128.0)
    assert ours.offline_lens == (128, 128)
    theirs = _server_figures("vllm", runs, by_server["vllm"], marks, PeersConfig(), offline)
    assert (theirs.tpot_ms, theirs.offline_tok_s, theirs.prompt_len) == (None, 470.0, 126.0)


def test_medians_over_rounds_and_ratios_ours_over_theirs():
    runs = [
        _figures("splitserve", 1, 16, 100.0, 900.0, 0.0, 0.0),
        _figures("splitserve", 2, 16, 120.0, 1100.0, 0.0, 0.0),
        _figures("splitserve", 3, 16, 300.0, 5000.0, 0.0, 0.0),  # median of three: 120
        _figures("splitserve", 1, 1, 0.0, 0.0, 20.0, 150.0),
        _figures("vllm", 1, 16, 200.0, 1000.0, 0.0, 0.0),
        _figures("vllm", 1, 1, 0.0, 0.0, 40.0, 100.0),
        _figures("vllm", 2, 1, 0.0, 0.0, 60.0, 100.0, completed=0),  # all failed: left out
    ]
    marks = headlines((1, 16))
    assert [m.name for m in marks] == [
        "c=16 output tok/s", "c=16 TTFT p99 ms", "c=1 TPOT p50 ms", "c=1 TTFT p50 ms"
    ]  # fmt: skip
    by_server = medians(runs, marks)
    assert by_server["splitserve"] == {
        "c=16 output tok/s": 120.0,
        "c=16 TTFT p99 ms": 1100.0,
        "c=1 TPOT p50 ms": 20.0,
        "c=1 TTFT p50 ms": 150.0,
    }
    assert by_server["vllm"]["c=1 TPOT p50 ms"] == 40.0
    assert ratios(by_server) == {
        "splitserve/vllm": {
            "c=16 output tok/s": pytest.approx(0.6),
            "c=16 TTFT p99 ms": pytest.approx(1.1),
            "c=1 TPOT p50 ms": pytest.approx(0.5),
            "c=1 TTFT p50 ms": pytest.approx(1.5),
        }
    }
    table = format_summary(by_server, ratios(by_server), marks)
    assert "| c=1 TPOT p50 ms | 20.0 | 40.0 | 0.50x |" in table
    assert "| splitserve/vllm |" in table.splitlines()[0]


def test_a_figure_missing_on_either_side_has_no_ratio():
    by_server = {"splitserve": {"a": 2.0}, "vllm": {"a": 0.0, "b": 1.0}, "llama.cpp": {}}
    assert ratios(by_server) == {"splitserve/vllm": {}, "splitserve/llama.cpp": {}}


def test_the_mesh_of_vllm_workers_is_compared_with_vllms_server_only():
    by_server = {
        "splitserve": {"a": 2.0},
        "vllm": {"a": 4.0},
        "llama.cpp": {"a": 1.0},
        "splitserve-vllm": {"a": 3.0},
    }
    assert ratios(by_server) == {
        "splitserve/vllm": {"a": 0.5},
        "splitserve/llama.cpp": {"a": 2.0},
        "splitserve-vllm/vllm": {"a": 0.75},
    }
    without_native = {k: v for k, v in by_server.items() if k != "splitserve"}
    assert ratios(without_native) == {"splitserve-vllm/vllm": {"a": 0.75}}
    marks = headlines((1,))
    table = format_summary({"vllm": {}, "splitserve-vllm": {}}, ratios(by_server), marks)
    assert table.splitlines()[0].endswith("| splitserve-vllm/vllm |")


def test_the_mesh_of_vllm_workers_runs_one_prefill_and_one_decode_with_vllms_kv_cache():
    args = vllm_mesh_args(kv_cache_gib=1)
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs == {
        "--engine": "vllm", "--block-size": "32", "--dtype": "bfloat16", "--prefill": "1",
        "--decode": "1", "--kv-cache-gib": "1",
    }  # fmt: skip


def test_flags_after_the_dashes_reach_both_of_our_meshes_and_override_the_rows_own(
    monkeypatch, tmp_path
):
    import loadtest.mesh

    started: dict[str, list[str]] = {}

    class Recorded:
        def __init__(self, model_dir: Path, extra: list[str], log_path: Path) -> None:
            started[log_path.name] = extra

    monkeypatch.setattr(loadtest.mesh, "MeshProcess", Recorded)
    cfg = PeersConfig(up_args=("--dtype", "float32"), out=tmp_path)
    peers = prepare.Peers(cfg, cpus=[0, 1])
    for server in ("splitserve", "splitserve-vllm"):
        peers.start(Turn(1, server), tmp_path)
    assert started["splitserve-r1.log"] == ["--dtype", "float32"]
    vllm_mesh = started["splitserve-vllm-r1.log"]
    assert vllm_mesh[:2] == ["--engine", "vllm"] and vllm_mesh[-2:] == ["--dtype", "float32"]


@pytest.mark.parametrize("has_vllm", [True, False])
def test_the_mesh_of_vllm_workers_runs_only_where_splitserves_venv_has_vllm(
    has_vllm, monkeypatch, tmp_path
):
    monkeypatch.setattr(prepare, "has_vllm", lambda: has_vllm)
    cfg = PeersConfig(servers=("splitserve", "splitserve-vllm"), offline=None, out=tmp_path)
    peers = prepare.prepare_peers(cfg, tmp_path)
    assert ("splitserve-vllm" in peers.ready) is has_vllm
    assert ("make install ENGINE=vllm" in peers.skipped.get("splitserve-vllm", "")) is not has_vllm


def test_headlines_follow_the_concurrencies_given():
    assert {m.concurrency for m in headlines((4,))} == {4}
    assert [m.concurrency for m in headlines((2, 8, 32))] == [32, 32, 2, 2]


def test_run_figures_come_from_the_harness_summary():
    send = 10.0
    records = [
        RequestRecord("w", send, [send + 0.1 + 0.02 * i for i in range(11)], 128, 11,
                      usage_reported=True, end=send + 0.4),
    ]  # fmt: skip
    figures = RunFigures.of(Turn(2, "vllm"), 1, summarize(records, 0.5))
    assert (figures.server, figures.round, figures.concurrency) == ("vllm", 2, 1)
    assert figures.output_tok_s == pytest.approx(22.0)
    assert figures.ttft_p50_ms == pytest.approx(100.0)
    assert figures.tpot_p50_ms == pytest.approx(20.0)
    assert "round 2 vllm" in figures.line()


def test_cpu_ranges_compress_runs():
    assert cpu_ranges([0, 1]) == "0-1"
    assert cpu_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError):
        cpu_ranges([])


def test_vllm_command_line_and_environment():
    env = vllm_env([0, 1, 2, 3], kv_cache_gib=2)
    assert env == {
        "OMP_NUM_THREADS": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "0-3",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    command = vllm_command(Path("/v/bin/python"), Path("/m"), "smol", 8123, env)
    argv = command.argv
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/m"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert command.env is env and command.ready_path == "/health"


def test_llama_server_command_gives_a_slot_per_concurrent_request():
    argv = llama_server_command(Path("/b/llama-server"), Path("/m.gguf"), "smol", 9, 2, 16).argv
    assert argv[0] == "/b/llama-server"
    assert argv[argv.index("--model") + 1] == "/m.gguf"
    assert argv[argv.index("--threads") + 1] == "2"
    assert argv[argv.index("--parallel") + 1] == "16"
    assert int(argv[argv.index("--ctx-size") + 1]) >= 16 * 256  # 128 in + 128 out per slot


def test_word_prompts_are_fixed_by_the_seed():
    first = word_requests(4, 100, 128, seed=1)
    assert first == word_requests(4, 100, 128, seed=1)
    assert first != word_requests(4, 100, 128, seed=2)
    assert all(len(r.prompt.split()) == 100 and r.output_len == 128 for r in first)
    assert len({r.prompt for r in first}) == 4


def test_cli_passes_up_flags_after_the_double_dash():
    argv = ["bench", "peers", "--rounds", "1", "--servers", "splitserve,vllm", "--concurrency",
            "1,4", "--", "--dtype", "bfloat16"]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.up_args == ["--dtype", "bfloat16"]
    assert (args.rounds, args.servers, args.concurrency) == (1, "splitserve,vllm", "1,4")


def test_bad_cli_input_exits_with_the_reason():
    args = build_parser().parse_args(["bench", "peers", "--servers", "splitserve,tgi"])
    with pytest.raises(SystemExit, match="unknown server 'tgi'"):
        args.func(args)


def _executable(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_peer_that_exits_is_reported_with_its_log(tmp_path):
    command = ServerCommand([str(_executable(tmp_path / "srv", "echo boom; exit 3"))], {}, "/h")
    server = PeerProcess("vllm", command, 1, tmp_path / "vllm.log")
    with pytest.raises(RuntimeError, match=r"vllm exited \(3\); see .*vllm.log"):
        server.wait_ready(30.0)
    assert "boom" in (tmp_path / "vllm.log").read_text()


def test_a_peer_never_ready_times_out_and_is_stopped(tmp_path):
    command = ServerCommand([str(_executable(tmp_path / "srv", "exec sleep 60"))], {}, "/h")
    server = PeerProcess("llama.cpp", command, 1, tmp_path / "llama.log")
    with pytest.raises(TimeoutError, match=r"llama\.cpp not ready in 1 s"):
        server.wait_ready(1.0)
    server.stop()
    assert server.process.poll() is not None
