"""`splitserve up --config FILE`: the command table has each mesh model's own pools (with its
name and engine flags) and a gateway that reads the same file; a bad file stops `up`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.launch_plan import LauncherConfig, child_specs
from services.launcher import metrics_ports
from services.mesh_config import load_mesh_config

CONFIG = """\
models:
  - {name: smol-a, model_dir: a, aggregated: 2, engine: {max_num_seqs: 4}}
  - {name: smol-b, model_dir: b, prefill: 1, decode: 1}
  - {name: remote, upstream: "http://127.0.0.1:9/v1"}
"""


def test_each_mesh_model_gets_its_own_pools_and_the_gateway_the_file(tmp_path: Path):
    path = tmp_path / "mesh.yaml"
    path.write_text(CONFIG)
    mesh = load_mesh_config(path)
    config = LauncherConfig(home=tmp_path, model_dir=tmp_path / "a", mesh=mesh,
                            worker_args=("--dtype", "float32"))  # fmt: skip
    specs = {
        spec.name: spec.argv for spec in child_specs(config, "nats://x:1", metrics_ports(config))
    }
    workers = sorted(name for name in specs if name.startswith("worker "))
    assert workers == [
        "worker smol-a-both-0", "worker smol-a-both-1", "worker smol-b-decode-0",
        "worker smol-b-prefill-0",
    ]  # fmt: skip
    a = specs["worker smol-a-both-1"]
    assert a[a.index("--model-dir") + 1] == str(tmp_path / "a")
    assert a[a.index("--model-name") + 1] == "smol-a" and a[a.index("--role") + 1] == "both"
    # The file's engine flags come after the command line's, so they win.
    assert a.index("--max-num-seqs") > a.index("--dtype")
    b = specs["worker smol-b-decode-0"]
    assert b[b.index("--model-dir") + 1] == str(tmp_path / "b") and "--max-num-seqs" not in b
    gateway = specs["gateway"]
    assert gateway[gateway.index("--mesh-config") + 1] == str(path)
    assert gateway[gateway.index("--served-model-name") + 1] == "smol-a"


def test_up_refuses_a_bad_config_naming_its_line(tmp_path: Path):
    path = tmp_path / "mesh.yaml"
    path.write_text(CONFIG.replace("prefill: 1, decode: 1", "prefill: 1"))
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"{path}:3: model 'smol-b' has no workers" in done.stderr, done.stderr


def test_up_refuses_pool_flags_beside_a_config(tmp_path: Path):
    path = tmp_path / "mesh.yaml"
    path.write_text(CONFIG)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--config", str(path), "--decode", "3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "drop --model, --model-dir, --prefill" in done.stderr
