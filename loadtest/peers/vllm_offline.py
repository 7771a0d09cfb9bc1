"""vLLM's offline throughput: run by `splitserve bench peers` with the peers' venv python.

A standalone script (it imports nothing of ours, and vLLM is not in our venv): reads sets of
token-id prompts from a JSON file, runs `LLM.generate` on all prompts of a set at once (greedy,
ignore_eos, after a short warm-up), a set after the other, and writes
`{"runs": [{output_tokens, seconds, output_tok_s}, ...]}` as JSON, a run a set.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument(
        "--prompts", type=Path, required=True, help="JSON list of prompt sets (token-id lists)"
    )
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sets = [
        [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
        for prompts in json.loads(args.prompts.read_text())
    ]
    llm = LLM(model=args.model_dir, dtype=args.dtype, seed=0)
    warmup = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(sets[0][:2], warmup, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    runs = []
    for prompts in sets:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        runs.append({"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds})
    args.out.write_text(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
