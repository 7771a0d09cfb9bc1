"""compose/Dockerfile and compose/Dockerfile.cuda: they install the project with the
Makefile's own recipe (checked with `make -n`), copy every package the build needs, bake no
model in, run as a non-root user, and start `splitserve` whatever the role."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    ROOT / "compose" / "Dockerfile": "https://download.pytorch.org/whl/cpu",
    ROOT / "compose" / "Dockerfile.cuda": "https://download.pytorch.org/whl/cu",
}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [ln for ln in dockerfile.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.strip().partition(" ") for line in joined.splitlines())
        if word
    ]


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def dockerfile_env(dockerfile: Path) -> dict[str, str]:
    """The ENV of the final stage (`KEY=value` pairs)."""
    pairs = [
        pair.split("=", 1)
        for word, rest in final_stage(dockerfile)
        if word == "ENV"
        for pair in shlex.split(rest)
    ]
    return dict(pairs)


def _without_outer_make() -> dict[str, str]:
    """The environment without an outer make's variables: `make test ENGINE=vllm` hands
    ENGINE down, in MAKEFLAGS and as an environment variable."""
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ENGINE", "VLLM_WHEEL")
    return {k: v for k, v in os.environ.items() if k not in outer}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_install_is_the_makefile_recipe(dockerfile: Path) -> None:
    runs = [rest for word, rest in instructions(dockerfile) if word == "RUN"]
    assert not any("pip" in run for run in runs), "pip belongs to the Makefile's recipe"
    makes = [shlex.split(run) for run in runs if run.startswith("make ")]
    assert len(makes) == 1 and makes[0][1] == "install"
    dry_run = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), *makes[0][1:]],
        env=_without_outer_make(),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    pip = [line for line in dry_run.splitlines() if " -m pip install " in line]
    # The CUDA image adds vLLM after the project (ENGINE=vllm: the wheel, then NIXL's selector).
    assert len(pip) == (4 if "ENGINE=vllm" in makes[0] else 2)
    assert f"--index-url {DOCKERFILES[dockerfile]}" in pip[0] and " torch==" in pip[0]
    assert pip[1].endswith("pip install --quiet .")  # the project, no dev tools, not editable


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copies_every_package_the_build_needs(dockerfile: Path) -> None:
    copies = [shlex.split(rest) for word, rest in instructions(dockerfile) if word == "COPY"]
    sources = {src for args in copies if not args[0].startswith("--") for src in args[:-1]}
    assert all((ROOT / src).exists() for src in sources), sources
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages | {"pyproject.toml", "Makefile", pyproject["project"]["readme"]} <= sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runtime_stage_is_one_non_root_image_without_a_model(dockerfile: Path) -> None:
    steps = final_stage(dockerfile)
    words = dict(steps)
    assert words["USER"] not in ("root", "0")
    assert words["ENTRYPOINT"] == '["splitserve"]'
    home = dockerfile_env(dockerfile)["SPLITSERVE_HOME"]
    assert words["VOLUME"] == home
    everything = " ".join(rest for _, rest in instructions(dockerfile))
    assert "splitserve pull" not in everything and "models" not in everything
    assert ("COPY", "--from=build /opt/splitserve /opt/splitserve") in steps
