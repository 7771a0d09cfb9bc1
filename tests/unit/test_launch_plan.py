"""The plan of `splitserve up` (services/launch_plan.py), a pure function: its children in
start order with their roles and /metrics ports, the flags `up` sets on each, the flags it
forwards to each service and to none other, `up`'s own flags (declared with `flag()`,
without variables but `--namespace` and `--log-level`), and `--pool`: one worker pinned to
its cores per pool, refused beside the count flags."""

from __future__ import annotations

from itertools import count
from pathlib import Path

import pytest

from services.cli import build_parser
from services.launch_cli import config_from_args
from services.launch_plan import LauncherConfig, child_specs, worker_template
from services.planner.config import PlannerServiceConfig
from services.worker.cli import config_from_args as worker_config
from shared.errors import ConfigError
from shared.flags import settings
from shared.nats_auth import service_role

HOME, MODEL = Path("/h"), Path("/m")


def option(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_children_in_start_order_with_their_roles_and_metrics_ports():
    config = LauncherConfig(home=HOME, model_dir=MODEL, prefill=2, decode=1)
    ports = count(9300)
    specs = child_specs(config, "nats://n:1", ports)
    assert [(s.name, s.role) for s in specs] == [
        ("scheduler", "scheduler"),
        ("worker prefill-0", "worker"),
        ("worker prefill-1", "worker"),
        ("worker decode-0", "worker"),
        ("gateway", "gateway"),
    ]
    assert [s.metrics_port for s in specs] == [9300, 9301, 9302, 9303, None]
    for spec in specs[:-1]:
        assert option(spec.argv, "--metrics-port") == str(spec.metrics_port)
    assert "--metrics-port" not in specs[-1].argv  # /metrics on the gateway's own port
    assert next(ports) == 9304  # one port drawn per scheduler and worker, no more
    workers = specs[1:-1]
    assert [option(s.argv, "--role") for s in workers] == ["prefill", "prefill", "decode"]
    assert [option(s.argv, "--worker-id") for s in workers] == [
        "prefill-0",
        "prefill-1",
        "decode-0",
    ]
    assert {option(s.argv, "--model-dir") for s in workers} == {"/m"}


def test_an_aggregated_mesh_has_one_pool_of_role_both():
    config = LauncherConfig(home=HOME, model_dir=MODEL, prefill=2, aggregated=True, decode=0)
    workers = [s for s in child_specs(config, "u", count(1)) if s.role == "worker"]
    assert [option(s.argv, "--worker-id") for s in workers] == ["both-0", "both-1"]
    assert {option(s.argv, "--role") for s in workers} == {"both"}


def test_every_child_gets_the_nats_url_namespace_credentials_and_trace_endpoint():
    config = LauncherConfig(
        home=HOME,
        model_dir=MODEL,
        namespace="blue",
        otlp_endpoint="http://otel:4318",
        nats_args=("--nats-user", "mesh"),
        host="0.0.0.0",
        port=8123,
    )
    specs = child_specs(config, "nats://a:4222,nats://b:4222", count(1))
    for spec in specs:
        assert spec.argv[1:3] == ("-m", "services.cli")
        assert option(spec.argv, "--nats") == "nats://a:4222,nats://b:4222"
        assert option(spec.argv, "--namespace") == "blue"
        assert option(spec.argv, "--otlp-endpoint") == "http://otel:4318"
        assert option(spec.argv, "--nats-user") == "mesh"
    gateway = specs[-1].argv
    assert (option(gateway, "--host"), option(gateway, "--port")) == ("0.0.0.0", "8123")
    assert option(gateway, "--model-dir") == "/m"
    quiet = child_specs(LauncherConfig(home=HOME, model_dir=MODEL), "u", count(1))
    assert not any("--otlp-endpoint" in s.argv for s in quiet)


def test_forwarded_flags_reach_their_service_alone():
    config = LauncherConfig(
        home=HOME,
        model_dir=MODEL,
        worker_args=("--dtype", "float32"),
        gateway_args=("--max-pending", "7"),
        scheduler_args=("--max-queue", "9"),
    )
    argvs = {s.name: s.argv for s in child_specs(config, "u", count(1))}
    for name, argv in argvs.items():
        assert ("--dtype" in argv) == name.startswith("worker"), name
        assert ("--max-pending" in argv) == (name == "gateway"), name
        assert ("--max-queue" in argv) == (name == "scheduler"), name
    assert argvs["worker decode-0"][-2:] == ("--dtype", "float32")  # after what up sets


def test_the_cli_forwards_the_flags_that_differ_from_their_defaults():
    argv = ["up", "--model-dir", "/m", "--prefill", "3", "--block-size", "32"]
    argv += ["--max-queue", "9", "--cors-origins", "*", "--kv-transport", "nats"]
    config = config_from_args(build_parser().parse_args(argv), HOME)
    assert (config.prefill, config.decode, config.model_dir) == (3, 1, MODEL)
    assert config.worker_args == ("--block-size", "32", "--kv-transport", "nats")
    assert config.scheduler_args == ("--max-queue", "9", "--block-size", "32")
    assert config.gateway_args == ("--cors-origins", "*")
    assert config.nats_args == ()  # its own nats-server: credentials come from the run
    plain = config_from_args(build_parser().parse_args(["up"]), HOME)
    assert (plain.worker_args, plain.scheduler_args, plain.gateway_args) == ((), (), ())
    assert plain == LauncherConfig(home=HOME)  # every flag's default is the field's


def test_ups_own_flags_read_no_variable_but_namespace_and_log_level(monkeypatch):
    variables = {s.name: s.variable for s in settings(LauncherConfig)}
    assert {name for name, variable in variables.items() if variable} == {
        "namespace",
        "log_level",
    }
    monkeypatch.setenv("SPLITSERVE_PORT", "9999")  # the gateway's variable, not up's
    monkeypatch.setenv("SPLITSERVE_NAMESPACE", "green")
    config = config_from_args(build_parser().parse_args(["up"]), HOME)
    assert (config.port, config.namespace) == (8000, "green")


def test_pools_start_one_pinned_worker_each_in_place_of_the_counts():
    argv = ["up", "--model-dir", "/m", "--pool", "prefill:0", "--pool", "decode:1"]
    config = config_from_args(build_parser().parse_args(argv), HOME)
    workers = [s for s in child_specs(config, "u", count(1)) if s.role == "worker"]
    assert [(s.name, option(s.argv, "--role"), option(s.argv, "--cpus")) for s in workers] == [
        ("worker prefill-0", "prefill", "0"),
        ("worker decode-0", "decode", "1"),
    ]
    both = LauncherConfig(home=HOME, model_dir=MODEL, pools=("both:0", "2", "both:1"))
    workers = [s for s in child_specs(both, "u", count(1)) if s.role == "worker"]
    assert [(option(s.argv, "--worker-id"), option(s.argv, "--cpus")) for s in workers] == [
        ("both-0", "0,2"),  # a core list split at its comma by the flag is joined again
        ("both-1", "1"),
    ]
    plain = child_specs(LauncherConfig(home=HOME, model_dir=MODEL), "u", count(1))
    assert not any("--cpus" in s.argv for s in plain)  # no pool: unpinned, as before


def test_each_pinned_worker_parses_its_cpus_and_runs_a_thread_per_core():
    argv = ["up", "--model-dir", "/m", "--pool", "both:0-1", "--max-num-seqs", "8"]
    config = config_from_args(build_parser().parse_args(argv), HOME)
    (worker,) = [s for s in child_specs(config, "u", count(1)) if s.role == "worker"]
    parsed = worker_config(build_parser().parse_args(worker.argv[3:]))
    assert (parsed.role, parsed.pinned_cpus, parsed.engine.max_num_seqs) == ("both", (0, 1), 8)
    assert parsed.engine_config().num_threads == 2


def test_pools_beside_the_count_flags_are_refused():
    for flags in (["--aggregated"], ["--prefill", "2"], ["--decode", "3"]):
        argv = ["up", "--model-dir", "/m", "--pool", "both:0", *flags]
        args = build_parser().parse_args(argv)
        with pytest.raises(ConfigError, match="--pool names every worker and its cores: drop"):
            config_from_args(args, HOME)
    for pools, message in [
        (("prefill:0",), "no decode or both worker"),
        (("both:0", "both:0-1"), "core 0 is in two pools"),
        (("gpu:0",), "the role must be one of"),
        (("both:",), "no core given"),
    ]:
        with pytest.raises(ConfigError, match=message):
            LauncherConfig(home=HOME, model_dir=MODEL, pools=pools)
    up = build_parser().parse_args(["up", "--model-dir", "/none", "--pool", "both:100000"])
    with pytest.raises(SystemExit, match="splitserve up: cpus 100000: not among"):
        up.func(up)


def test_planner_starts_after_the_workers_with_its_flags_and_mode():
    argv = ["up", "--model-dir", "/m", "--planner", "--slo", "ttft=2,tpot=50ms"]
    argv += ["--planner-hold", "4", "--max-queue", "9"]
    config = config_from_args(build_parser().parse_args(argv), HOME)
    assert config.planner_args == ("--slo", "ttft=2,tpot=50ms", "--planner-hold", "4")
    specs = child_specs(config, "nats://n:1", count(9300))
    assert [(s.name, s.role) for s in specs][-2:] == [
        ("planner", "planner"),
        ("gateway", "gateway"),
    ]
    planner = specs[-2]
    assert planner.argv[planner.argv.index("-m") + 2] == "planner"
    assert option(planner.argv, "--nats") == "nats://n:1"
    assert option(planner.argv, "--metrics-port") == str(planner.metrics_port)
    assert "--planner-mode" not in planner.argv  # auto: replicas
    assert "--max-queue" not in planner.argv
    assert service_role(planner.role) == "planner"  # its own NATS user
    parsed = build_parser().parse_args(list(planner.argv[planner.argv.index("-m") + 2 :]))
    service = PlannerServiceConfig.from_args(parsed)
    policy = service.policy
    assert (policy.mode, policy.ttft_slo, policy.tpot_slo, policy.hold) == (
        "replicas", 2.0, pytest.approx(0.05), 4,
    )  # fmt: skip
    assert all(s.name != "planner" for s in child_specs(LauncherConfig(home=HOME), "u", count(1)))


def test_the_planners_objectives_reach_the_path_choice_unless_it_has_its_own():
    """`up --planner --slo S`: the scheduler's path choice keeps S too (auto → slo); a
    `--path-slo` or `--path-choice` of the user's wins, and without --planner nothing is added."""
    up = ["up", "--model-dir", "/m", "--planner", "--slo", "ttft=2,tpot=50ms"]
    config = config_from_args(build_parser().parse_args(up), HOME)
    assert config.scheduler_args == ("--path-slo", "ttft=2,tpot=50ms")
    scheduler = next(s for s in child_specs(config, "u", count(1)) if s.role == "scheduler")
    assert option(scheduler.argv, "--path-slo") == "ttft=2,tpot=50ms"
    for own in (["--path-slo", "ttft=3,tpot=60ms"], ["--path-choice", "fixed"]):
        config = config_from_args(build_parser().parse_args(up + own), HOME)
        assert config.scheduler_args == tuple(own)
    plain = ["up", "--model-dir", "/m", "--slo", "ttft=2,tpot=50ms"]
    assert config_from_args(build_parser().parse_args(plain), HOME).scheduler_args == ()


def test_planner_under_pinned_pools_changes_roles_unless_told():
    pools = ["up", "--model-dir", "/m", "--pool", "both:0", "--pool", "both:1", "--planner"]
    for extra, mode in (([], "roles"), (["--planner-mode", "replicas"], "replicas")):
        config = config_from_args(build_parser().parse_args(pools + extra), HOME)
        (planner,) = [s for s in child_specs(config, "u", count(1)) if s.role == "planner"]
        parsed = build_parser().parse_args(list(planner.argv[planner.argv.index("-m") + 2 :]))
        assert PlannerServiceConfig.from_args(parsed).policy.mode == mode


def test_planner_beside_a_mesh_config_is_refused():
    with pytest.raises(ConfigError, match="--planner"):
        LauncherConfig(home=HOME, planner=True, mesh_file=Path("mesh.yaml"))


def test_the_planners_bad_objectives_are_refused_before_anything_starts():
    for bad in (["--slo", "ttft=fast"], ["--planner-min-per-role", "5"]):
        args = build_parser().parse_args(["up", "--planner", *bad])
        with pytest.raises(ConfigError):
            config_from_args(args, HOME)
    args = build_parser().parse_args(["up", "--slo", "ttft=fast"])  # no planner: not read
    assert config_from_args(args, HOME).planner_args == ("--slo", "ttft=fast")


def test_a_worker_added_while_serving_starts_as_the_plans_own_do():
    """`worker_template` makes the plan's workers and those a PoolTarget adds: the same
    command but for the id, the role, the cores and the metrics port."""
    argv = ["up", "--model-dir", "/m", "--pool", "prefill:0", "--pool", "decode:1"]
    argv += ["--block-size", "32", "--max-workers", "3"]
    config = config_from_args(build_parser().parse_args(argv), HOME)
    assert (config.max_workers, config.follow_pool) == (3, True)
    specs = child_specs(config, "nats://n:1", count(9300))
    planned = specs[2]  # decode-0
    assert (planned.worker_role, planned.worker_id, planned.cpus) == ("decode", "decode-0", (1,))
    template = worker_template(config, "nats://n:1")
    assert [(p.role, p.cpus) for p in template.pools] == [("prefill", (0,)), ("decode", (1,))]
    assert template.spec("decode", "decode-0", (1,), 9302) == planned
    added = template.spec("both", "both-0", (2, 3), 9400)
    assert added.argv == tuple(
        {"decode": "both", "decode-0": "both-0", "1": "2-3", "9302": "9400"}.get(a, a)
        for a in planned.argv
    )
    assert option(added.argv, "--block-size") == "32"  # forwarded flags, as the plan's
    assert (added.name, added.role, added.metrics_port) == ("worker both-0", "worker", 9400)


def test_up_follows_pool_targets_as_its_own_nats_user_or_with_the_given_flags():
    argv = ["up", "--nats", "nats://a:4222", "--nats-user", "mesh", "--no-follow-pool"]
    config = config_from_args(build_parser().parse_args(argv), HOME)
    assert (config.nats_auth.nats_user, config.follow_pool) == ("mesh", False)
    assert config_from_args(build_parser().parse_args(["up"]), HOME).nats_auth.nats_user == ""
    with pytest.raises(ConfigError, match="--max-workers must be >= 0"):
        LauncherConfig(home=HOME, max_workers=-1)
