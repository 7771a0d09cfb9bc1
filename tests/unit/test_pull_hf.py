"""`splitserve pull hf:ORG/NAME` through huggingface_hub, offline, against a Hugging Face
cache laid out in the test (HF_HOME), since no hub is reachable here. huggingface_hub reads
its environment when imported, so each pull runs the CLI in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import write_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_cache(hf_home: Path, repo: str, architecture: str = "LlamaForCausalLM") -> Path:
    """A snapshot of `repo` in HF_HOME's hub cache, as huggingface_hub lays it out."""
    org, name = repo.split("/")
    root = hf_home / "hub" / f"models--{org}--{name}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = write_tiny_model(root / "snapshots" / COMMIT)
    config = json.loads((snapshot / "config.json").read_text())
    config["architectures"] = [architecture]
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot


def pull(name: str, hf_home: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_test"}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "pull", name],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_pull_returns_the_cached_snapshot_offline(tmp_path):
    snapshot = make_cache(tmp_path / "hf", "tiny-org/tiny-llama")
    done = pull("hf:tiny-org/tiny-llama", tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == snapshot.resolve()


@pytest.mark.slow
def test_pull_refuses_what_is_not_cached_or_not_served(tmp_path):
    make_cache(tmp_path / "hf", "tiny-org/tiny-mamba", architecture="MambaForCausalLM")
    missing = pull("hf:tiny-org/absent", tmp_path / "hf")
    assert missing.returncode != 0
    assert "not in the local Hugging Face cache" in missing.stderr
    unserved = pull("hf:tiny-org/tiny-mamba", tmp_path / "hf")
    assert unserved.returncode != 0
    assert "MambaForCausalLM is not served" in unserved.stderr
    assert "--engine vllm" in unserved.stderr
    malformed = pull("hf:no-slash", tmp_path / "hf")
    assert "expected hf:ORG/NAME" in malformed.stderr
