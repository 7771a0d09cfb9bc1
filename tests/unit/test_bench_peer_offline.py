"""The offline comparison of `splitserve bench peers` without vLLM: the prompt sets, the best
run and the unstable flag, and vllm_offline.py driven through a stand-in `vllm` package (the
script's loop, its JSON and the deadline around it)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from loadtest.peers.offline import (
    VLLM_OFFLINE_SCRIPT,
    OfflineConfig,
    OfflineResult,
    offline_prompt_sets,
    vllm_offline,
    vllm_offline_command,
)
from services.cli import build_parser

# A stand-in for vLLM's offline API: every generate call is logged (its prompts' token ids
# and max_tokens), and every prompt gets max_tokens tokens.
FAKE_VLLM = """
import json, os
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.max_tokens = max_tokens
class _Completion:
    def __init__(self, n):
        self.token_ids = list(range(n))
class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]
class LLM:
    def __init__(self, model, dtype, seed):
        self.calls = os.environ["FAKE_VLLM_CALLS"]
    def generate(self, prompts, params, use_tqdm):
        with open(self.calls, "a") as log:
            ids = [p["prompt_token_ids"] for p in prompts]
            log.write(json.dumps({"prompts": ids, "max_tokens": params.max_tokens}) + "\\n")
        return [_Output(params.max_tokens) for _ in prompts]
"""
FAKE_INPUTS = """
def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}
"""


def _executable(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_vllm_offline_runs_a_standalone_script():
    command = vllm_offline_command(Path("/v/python"), Path("/m"), Path("/p.json"), 128, Path("/o"))
    assert command[:2] == ["/v/python", str(VLLM_OFFLINE_SCRIPT)]
    assert command[command.index("--output-len") + 1] == "128"
    tree = ast.parse(VLLM_OFFLINE_SCRIPT.read_text())
    imported = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not imported & {"services", "shared", "loadtest"}  # none of ours in vLLM's venv


def test_the_best_run_of_each_side_counts_and_a_wide_spread_is_flagged():
    steady = OfflineResult(ours_runs=(300.0, 290.0), vllm_runs=(190.0, 200.0))
    assert (steady.ours_tok_s, steady.vllm_tok_s, steady.ratio) == (300.0, 200.0, 1.5)
    assert steady.unstable() == []
    assert "runs 300.0, 290.0" in steady.line() and "UNSTABLE" not in steady.line()
    disturbed = OfflineResult(ours_runs=(300.0, 290.0), vllm_runs=(180.0, 500.0))
    assert disturbed.ratio == 0.6 and disturbed.unstable() == ["vLLM"]
    assert "UNSTABLE: vLLM runs differ" in disturbed.line()
    assert disturbed.as_json() == {
        "ours_runs": (300.0, 290.0),
        "vllm_runs": (180.0, 500.0),
        "ours_tok_s": 300.0,
        "vllm_tok_s": 500.0,
        "ratio": 0.6,
        "unstable": ["vLLM"],
    }


def test_each_run_gets_its_own_prompts_fixed_by_the_seed():
    cfg = OfflineConfig(num_prompts=3, input_len=5, repeats=2)
    sets = offline_prompt_sets(cfg, vocab=1000)
    assert sets == offline_prompt_sets(cfg, vocab=1000)
    assert [len(s) for s in sets] == [3, 3] and {len(p) for s in sets for p in s} == {5}
    assert sets[0] != sets[1]  # a repeat of the same prompts would hit the prefix caches
    assert all(100 <= t < 1000 for s in sets for p in s for t in p)


def test_the_script_times_every_prompt_set_in_one_vllm(tmp_path):
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "inputs.py").write_text(FAKE_INPUTS)
    calls = tmp_path / "calls.jsonl"
    env = {"PYTHONPATH": str(tmp_path / "fake"), "FAKE_VLLM_CALLS": str(calls)}
    cfg = OfflineConfig(num_prompts=2, input_len=3, output_len=5, repeats=2, timeout_s=60)
    sets = offline_prompt_sets(cfg, vocab=500)
    runs = vllm_offline(Path(sys.executable), tmp_path, sets, cfg, env, tmp_path / "v.log")
    assert len(runs) == 2 and all(tok_s > 0 for tok_s in runs)
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    # the warm-up (two prompts, 8 tokens), then each set whole, in order
    assert logged == [
        {"prompts": sets[0][:2], "max_tokens": 8},
        {"prompts": sets[0], "max_tokens": 5},
        {"prompts": sets[1], "max_tokens": 5},
    ]


def test_vllm_offline_failures_and_deadline(tmp_path):
    prompt_sets, cfg = [[[101, 102]]], OfflineConfig(timeout_s=1.0)
    failing = _executable(tmp_path / "python-fails", "exit 2")
    with pytest.raises(RuntimeError, match=r"vLLM offline failed \(exit 2\)"):
        vllm_offline(failing, tmp_path, prompt_sets, cfg, {}, tmp_path / "a.log")
    slow = _executable(tmp_path / "python-slow", "exec sleep 60")
    with pytest.raises(RuntimeError, match="vLLM offline: no result in 1 s"):
        vllm_offline(slow, tmp_path, prompt_sets, cfg, {}, tmp_path / "b.log")
    # a script that answers for fewer sets than it was given
    short = _executable(
        tmp_path / "python-short",
        'while [ "$1" != "--out" ]; do shift; done; echo \'{"runs": []}\' > "$2"',
    )
    with pytest.raises(RuntimeError, match="0 runs for 1 prompt sets"):
        vllm_offline(short, tmp_path, prompt_sets, cfg, {}, tmp_path / "c.log")


def test_fewer_than_one_run_a_side_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        OfflineConfig(repeats=0)
    args = build_parser().parse_args(["bench", "peers", "--offline-repeats", "0"])
    with pytest.raises(SystemExit, match="offline repeats must be at least 1"):
        args.func(args)
