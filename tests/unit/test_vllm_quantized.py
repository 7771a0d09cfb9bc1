"""vLLM loads a compressed-tensors W8A8 checkpoint and a vLLM `fp8` one with 128 x 128 block
scales as our writer (tests/wna16_writer.py) makes them, the same directories our engine reads
(`--engine vllm` passes the model directory as it is): with its own kernels it picks the
prompt's next token it picks on the float model of exactly the stored weights, and most of the
same top 5 (vLLM quantizes the activations there: int8 per token, FP8 per group of 128). A
second reader of the layouts, beside compressed-tensors' own (test_wna16.py,
test_fp8_weights.py). Needs vLLM (`make install ENGINE=vllm`); each vLLM start takes ~25 s on
two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.models.wna16_config import QuantFormat
from tests.conftest import write_tiny_model
from tests.wna16_writer import Scheme, write_quantized

pytest.importorskip("vllm", reason="vLLM is not installed here (make install ENGINE=vllm)")
pytestmark = pytest.mark.slow

PROMPT = list(range(3, 30))
GREEDY = """
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=256,
              skip_tokenizer_init=True)
    out = llm.generate({"prompt_token_ids": json.loads(sys.argv[2])},
                       SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
    first = out[0].outputs[0].logprobs[0]
    top = sorted(first, key=lambda t: -first[t].logprob)[:5]
    print("RESULT", json.dumps({"top5": top,
                                "quantization": llm.llm_engine.model_config.quantization}))
"""


def vllm_greedy(model_dir: Path, tmp_path: Path) -> dict:
    script = tmp_path / "greedy.py"
    script.write_text(GREEDY)
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir), json.dumps(PROMPT)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


# vLLM's block-scaled FP8 needs every matrix's rows in whole blocks: K, V 2 x 64 = 128 rows
SHAPES = {
    "w8a8": ({"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}, "compressed-tensors"),
    "fp8-block": (
        {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
        | {"num_attention_heads": 4, "num_key_value_heads": 2},
        "fp8",
    ),
}
SCHEMES = {
    "w8a8": Scheme(QuantFormat.INT8, 8, 0, symmetric=True),
    "fp8-block": Scheme(QuantFormat.FP8_VLLM, 8, 0, symmetric=True, strategy="block"),
}


@pytest.mark.parametrize("name", SCHEMES)
def test_vllm_serves_the_checkpoint_as_the_float_model_of_its_weights(tmp_path, name):
    shape, method = SHAPES[name]
    write_tiny_model(tmp_path / "float", **shape)
    write_quantized(tmp_path / "float", tmp_path / name, SCHEMES[name], tmp_path / "weights")
    quantized = vllm_greedy(tmp_path / name, tmp_path)
    floats = vllm_greedy(tmp_path / "weights", tmp_path)
    assert quantized["quantization"] == method and floats["quantization"] is None
    assert len(quantized["top5"]) == 5
    assert quantized["top5"][0] == floats["top5"][0]
    assert len(set(quantized["top5"]) & set(floats["top5"])) >= 3
