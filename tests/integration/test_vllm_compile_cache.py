"""A vLLM worker's second start loads what its first compiled (issue 61): two processes, one
after the other, each with a worker's vLLM environment (vllm_engine_args.set_environment,
SPLITSERVE_HOME a fresh dir) and vLLM's compiled engine on a tiny model. The first compiles
and saves the model; the second loads it (vLLM's own counters: one AOT artifact loaded, no
compile) and generates the same greedy tokens. The counters, not the time, are checked.

Needs vLLM (`make install ENGINE=vllm`); skipped, saying so, without it. Each start compiles
or loads inductor's C++ kernels: tens of seconds on a small CPU box, minutes on a loaded one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import write_tiny_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed here (make install ENGINE=vllm)",
    ),
]

START_S = 420  # one start of the compiled engine, on a loaded 2-core box
ROOT = Path(__file__).resolve().parents[2]

START = """
import json, sys
from pathlib import Path
from services.worker.config import WorkerConfig
from services.worker.vllm_engine_args import set_environment
from shared.engine.engine_config import EngineConfig
model = Path(sys.argv[1])
engine = EngineConfig(model_dir=model, block_size=32, device="cpu", num_threads=1)
config = WorkerConfig(worker_id="w", role="both", model_name="t", engine_kind="vllm", engine=engine)
set_environment(config)
from vllm import LLM, SamplingParams
from vllm.compilation.counter import compilation_counter
from vllm.inputs import TokensPrompt
llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
          block_size=32, kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=64,
          max_num_seqs=2, seed=0)
params = SamplingParams(temperature=0, max_tokens=6, detokenize=False, ignore_eos=True)
out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9])], params)[0]
print("RESULT", json.dumps({
    "tokens": list(out.outputs[0].token_ids),
    "compiled": compilation_counter.num_aot_compiles,
    "loaded": compilation_counter.num_aot_artifacts_loaded,
}))
"""


def start(model: Path, home: Path) -> dict:
    """One start of a worker's compiled vLLM engine: its tokens and compile counters."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CACHE_ROOT"}
    env |= {"SPLITSERVE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", START, str(model)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=START_S, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[0].removeprefix("RESULT "))


@pytest.mark.timeout(2 * START_S + 60)
def test_the_second_start_loads_what_the_first_compiled(tmp_path):
    model = write_tiny_model(tmp_path / "tiny", head_dim=32)  # vLLM's CPU attention: 32 and up
    home = tmp_path / "home"
    first = start(model, home)
    assert (first["compiled"], first["loaded"]) == (1, 0)
    assert list((home / "vllm" / "torch_compile_cache" / "torch_aot_compile").iterdir())
    second = start(model, home)
    assert (second["compiled"], second["loaded"]) == (0, 1)
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 6
