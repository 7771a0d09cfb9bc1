"""The check that keeps deployment files honest: an invocation of `splitserve` written in
docker-compose.yml or a Kubernetes manifest (arguments plus environment) must use only flags
that `splitserve <cmd> --help` prints, must parse with the real parser, and every
`SPLITSERVE_*` variable it sets must change what that command reads. The deployment tests
call `invocation_problems` (and, for workers, `unreachable_engine_settings`: every engine
setting must have a route in the file); the tests here show that they catch what they should."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from argparse import Namespace
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

from services.cli import build_parser
from services.worker.cli import NOT_ENGINE_FLAGS
from shared.engine.engine_config import EngineConfig
from shared.flags import settings

SPLITSERVE = Path(sys.executable).with_name("splitserve")
# Values that parse as every env-backed flag's type (int, float, str, a list of keys); two,
# so that a probe equal to a flag's default cannot hide that the variable is read.
PROBES = ("7", "13")
# Read by the OpenTelemetry SDK itself (DESIGN.md §7) and by UCX under NIXL (the KV
# transport: UCX_TLS, UCX_TCP_PORT_RANGE), not by our flags.
FOREIGN_PREFIXES = ("OTEL_", "UCX_")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@functools.cache
def help_text(command: str) -> str:
    """What `splitserve <command> --help` prints, from the installed console script."""
    result = subprocess.run(
        [str(SPLITSERVE), command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"splitserve {command} --help failed: {result.stderr}"
    return result.stdout


def help_flags(command: str) -> set[str]:
    return set(_FLAG.findall(help_text(command)))


@contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ without any SPLITSERVE_* of this machine, plus `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    with mock.patch.dict(os.environ, clean | dict(env), clear=True):
        yield


def parse(argv: list[str], env: Mapping[str, str]) -> Namespace:
    """The real parser's result for `splitserve argv` under `env` (defaults read env)."""
    with _environment(env):
        return build_parser().parse_args(argv)


def invocation_problems(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """Why `splitserve argv` with environment `env` would not do what it says; [] if fine."""
    if not argv:
        return ["no command: the image's entrypoint alone prints its help"]
    command = argv[0]
    known = help_flags(command)
    problems = [
        f"{flag} is not a flag of `splitserve {command}`"
        for flag in (arg.split("=", 1)[0] for arg in argv[1:] if arg.startswith("--"))
        if flag not in known
    ]
    try:
        baseline = parse(argv, env)
    except SystemExit:
        return [*problems, f"`splitserve {' '.join(argv)}` does not parse with {dict(env)}"]
    for name in env:
        if name.startswith(FOREIGN_PREFIXES):
            continue
        if not name.startswith("SPLITSERVE_"):
            problems.append(f"{name} is read by nothing in `splitserve {command}`")
        elif not _is_read(argv, env, name, baseline, help_text(command)):
            problems.append(f"{name} changes nothing in `splitserve {' '.join(argv)}`")
    return problems


def _is_read(
    argv: list[str], env: Mapping[str, str], name: str, baseline: Namespace, help: str
) -> bool:
    """Whether `name` changes what `splitserve argv` does. A flag's default (`[NAME]` in its
    help) must change the parse for some valid probe, so a flag given in `argv` that
    overrides it is caught; a variable the help names otherwise is read at run time."""
    if f"[{name}]" not in help and name in help:
        return True
    changed = []
    for probe in PROBES:
        try:
            changed.append(parse(argv, {**env, name: probe}) != baseline)
        except SystemExit:
            continue
    return any(changed) or (not changed and f"[{name}]" in help)


def unreachable_engine_settings(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """The EngineConfig settings a `splitserve worker` invocation leaves no way to change:
    neither its flag in `argv` nor its `SPLITSERVE_*` variable in `env`."""
    given = {arg.split("=", 1)[0] for arg in argv}
    return [
        s.variable
        for s in settings(EngineConfig, NOT_ENGINE_FLAGS)
        if s.option not in given and s.variable not in env
    ]


def test_real_flags_and_env_pass() -> None:
    argv = ["worker", "--role=decode", "--model-dir=/m"]
    assert invocation_problems(argv, {"SPLITSERVE_NUM_THREADS": "4"}) == []
    assert invocation_problems(["pull", "x"], {"SPLITSERVE_HOME": "/h"}) == []


def test_unknown_flag_is_caught() -> None:
    problems = invocation_problems(["scheduler", "--no-such-flag=1"], {})
    assert any("--no-such-flag is not a flag" in p for p in problems)


def test_missing_required_flag_is_caught() -> None:
    assert any("does not parse" in p for p in invocation_problems(["gateway"], {}))


def test_env_that_nothing_reads_is_caught() -> None:
    argv = ["scheduler"]
    assert invocation_problems(argv, {"SPLITSERVE_NO_SUCH": "1"}) == [
        "SPLITSERVE_NO_SUCH changes nothing in `splitserve scheduler`"
    ]
    assert invocation_problems(argv, {"MODEL": "x"}) == [
        "MODEL is read by nothing in `splitserve scheduler`"
    ]


def test_ucx_variables_are_left_to_ucx() -> None:
    argv = ["worker", "--role=prefill", "--model-dir=/m"]
    assert invocation_problems(argv, {"UCX_TLS": "tcp,self", "UCX_TCP_PORT_RANGE": "1-2"}) == []
    assert invocation_problems(argv, {"NIXL_TLS": "tcp"}) == [
        "NIXL_TLS is read by nothing in `splitserve worker`"
    ]


def test_env_overridden_by_a_flag_is_caught() -> None:
    argv = ["worker", "--model-dir=/m", "--num-threads=2"]
    assert invocation_problems(argv, {"SPLITSERVE_NUM_THREADS": "4"}) == [
        "SPLITSERVE_NUM_THREADS changes nothing in "
        "`splitserve worker --model-dir=/m --num-threads=2`"
    ]


def test_an_engine_setting_without_a_route_is_caught() -> None:
    argv = ["worker", "--model-dir=/m", "--dtype=bfloat16"]
    missing = unreachable_engine_settings(argv, {"SPLITSERVE_DEVICE": ""})
    assert "SPLITSERVE_QUANTIZATION" in missing
    assert not {"SPLITSERVE_MODEL_DIR", "SPLITSERVE_DTYPE", "SPLITSERVE_DEVICE"} & set(missing)
