"""`splitserve bench sim calibrate`: the `cpu-here` cost model's step coefficients measured
again on this machine, with the engine's own forward step (ModelRunner.forward, as `bench
step` runs it) on the default model, at 1 and 2 torch threads (workers of 1 and 2 cores).

Timed steps: decode rows (1, 4, 16) at contexts 128 and 1024, and prompt chunks of
`CHUNK` tokens after 0, 512, 1024 and 1792 tokens; wall time, the fastest of `TRIALS` after
one warm-up (another process on the cores only ever adds time); fitted by fit.py. The
model's other figures (KV transfer, pool, start-up) are kept from the file as it was.

The one subtle rule: the engine is configured as a worker's is (`resolve`: on this CPU the
`auto` dtype may be bf16, and batch-invariant matmuls on), since that is what serves; a
float32 step can take half as long again.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from loadtest.sim import cost_model
from loadtest.sim.fit import DecodeTiming, PrefillTiming, fit_steps

CHUNK = 256
BLOCK = 16
TRIALS = 5
DECODE_ROWS = (1, 4, 16)
CONTEXTS = (128, 1024)
PROMPT_STARTS = (0, 512, 1024, 1792)
THREADS = (1, 2)


def calibrate(path: Path, model: str = "") -> None:
    import torch

    from loadtest.engine_bench.step import blocks_needed
    from shared.engine.engine_config import EngineConfig
    from shared.engine.model_config import ModelConfig
    from shared.engine.model_runner import ModelRunner, Span
    from shared.engine.resolve import resolve
    from shared.models.pull import pull_model
    from shared.models.registry import DEFAULT_MODEL

    model_dir = pull_model(model or DEFAULT_MODEL, keep_quant=False)
    longest = max(PROMPT_STARTS) + CHUNK
    blocks = max(blocks_needed((f"d{max(DECODE_ROWS)}",), max(CONTEXTS)), longest // BLOCK)
    config = resolve(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=blocks))
    runner = ModelRunner(config, ModelConfig.from_dir(model_dir), blocks, longest + 16)

    def timed(spans: list[Span]) -> float:
        runner.forward(spans)
        seconds = []
        for _ in range(TRIALS):
            began = time.perf_counter()
            runner.forward(spans)
            seconds.append(time.perf_counter() - began)
        return min(seconds)

    def decode_spans(rows: int, context: int) -> list[Span]:
        per = -(-(context + 1) // BLOCK)
        return [
            Span([100 + i], context, list(range(i * per, (i + 1) * per)), 1) for i in range(rows)
        ]

    old = cost_model.load(str(path))
    steps = {}
    for threads in THREADS:
        torch.set_num_threads(threads)
        decodes = [
            DecodeTiming(rows, context, timed(decode_spans(rows, context)))
            for rows in DECODE_ROWS
            for context in CONTEXTS
        ]
        prefills = []
        for start in PROMPT_STARTS:
            table = list(range(-(-(start + CHUNK) // BLOCK)))
            span = Span(list(range(100, 100 + CHUNK)), start, table, 1)
            prefills.append(PrefillTiming(((CHUNK, start),), timed([span])))
        for timing in (*decodes, *prefills):
            print(f"{threads} thread(s): {timing}")
        steps[threads] = fit_steps(prefills, decodes)
        print(f"{threads} thread(s): {steps[threads]}")
    source = f"calibrated on this machine ({model_dir.name} {config.dtype}, bench sim calibrate)"
    cost_model.save(replace(old, steps=steps, source=source), path)
    print(f"wrote {path}")
