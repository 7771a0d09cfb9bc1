"""`splitserve bench step`: where the time of one forward step goes, stage by stage.

Runs the engine's real forward (ModelRunner.forward on the model's weights, its KV cache and
attention backend) on fixed batches — `d1` / `d16`: decode of 1 or 16 sequences at a context
of `--context` tokens; `p128`: one prefill of 128 tokens — and times each stage: the matmuls
by matrix, attention, the per-row ops (norms, residual adds, RoPE + KV write, SiLU * up; see
model/layer_ops.py), the host tensors of the step, greedy sampling and the rest (Python glue,
the embedding). Time is this thread's CPU time with one torch thread (other load on a
shared machine does not count; with `--threads` N > 1 wall time, since the other threads'
work is not this thread's), the mean of `--trials` steps after two warm-ups. Each matmul's
line says the bytes its matrices hold (what a decode step reads of them) and the GB/s that
makes. `--group-quant-activations int8`: a checkpoint kept quantized through the
int8-activation kernel, as `splitserve up` runs it with that flag.

`--attention-backend torch` runs the torch path of every per-row op (the reference); `cpu`
(with the C++ kernels built) the native fused ops.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shared.engine.engine_config import EngineConfig
from shared.engine.model.linear_weights import LinearWeight, PackedGateUp
from shared.engine.model_config import ModelConfig
from shared.engine.model_runner import ModelRunner, Span
from shared.engine.quantization import matrix_bytes
from shared.engine.sampler import SamplingRow
from shared.engine.sampling_params import SamplingParams
from shared.errors import ConfigError

BLOCK = 16


@dataclass(slots=True, frozen=True)
class StepBenchConfig:
    model_dir: Path
    dtype: str = "float32"
    shapes: tuple[str, ...] = ("d1", "d16", "p128")
    context: int = 128  # tokens each decode sequence has before its new one
    trials: int = 7
    attention_backend: str = "auto"
    group_quant_activations: str = "auto"
    threads: int = 1


class StageClock:
    """Seconds by stage name (`now`: this thread's CPU time, or wall time), accumulated over
    wrapped calls; and the bytes of the matrices each matmul stage reads."""

    def __init__(self, now: Callable[[], float] = time.thread_time) -> None:
        self.now = now
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)

    def wrap(self, stage: str, call: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = self.now()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[stage] += self.now() - start

        return timed


class TimedLinear:
    """A layer's matrix, timed; `decoder.linear` calls it as w(x) (bias added after)."""

    def __init__(self, w: LinearWeight, stage: str, clock: StageClock) -> None:
        from shared.engine.model.decoder import linear

        self.call = clock.wrap(stage, lambda x: linear(x, w))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)


@dataclass(slots=True, frozen=True)
class TimedGateUp(PackedGateUp):
    """A PackedGateUp whose matmul with SiLU·up is timed."""

    clock: StageClock | None = None

    def silu_mul(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        run = PackedGateUp.silu_mul
        return self.clock.wrap("matmul gate_up + silu * up", run)(self, x, bf16_out)


def instrument(runner: ModelRunner, clock: StageClock) -> None:
    """Wraps the model's stages in `clock` (matmuls, attention, per-row ops, sampling): the
    Python layer's calls, so a layer does not run as one native call here."""
    model, weights = runner.model, runner.model.weights
    model.native_layers = None
    for i, layer in enumerate(weights.layers):
        matrices = {"qkv": layer.qkv, "o_proj": layer.o_proj}
        if layer.gate_up is not None:
            matrices |= {"gate_up": layer.gate_up, "down": layer.down}
        timed: dict[str, object] = {
            name: TimedLinear(w, f"matmul {name}", clock) for name, w in matrices.items()
        }
        for name, w in matrices.items():
            clock.bytes[f"matmul {name}"] += matrix_bytes(w)
        if isinstance(layer.gate_up, PackedGateUp):
            timed["gate_up"] = TimedGateUp(layer.gate_up.packed, layer.gate_up.inter, clock)
        weights.layers[i] = replace(layer, **timed)
    clock.bytes["matmul lm_head"] += matrix_bytes(weights.lm_head)
    head = TimedLinear(weights.lm_head, "matmul lm_head", clock)
    head_small = TimedLinear(weights.lm_head_column_major, "matmul lm_head", clock)
    weights.lm_head, weights.lm_head_column_major = head, head_small
    model.attention.attend = clock.wrap("attention", model.attention.attend)
    ops = model.ops
    ops.norm = clock.wrap("norm / add + norm", ops.norm)
    ops.add_norm = clock.wrap("norm / add + norm", ops.add_norm)
    ops.silu_mul = clock.wrap("silu * up", ops.silu_mul)
    ops.rope_write_kv = clock.wrap("rope + kv write", ops.rope_write_kv)


def spans_of(shape: str, context: int) -> list[Span]:
    """`dN`: N decodes at `context`; `pN`: one prefill of N tokens (disjoint blocks each)."""
    kind, n = shape[0], int(shape[1:])
    if kind == "d":
        blocks = -(-(context + 1) // BLOCK)
        return [
            Span([100 + i], context, list(range(i * blocks, (i + 1) * blocks)), 1) for i in range(n)
        ]
    if kind == "p":
        return [Span(list(range(100, 100 + n)), 0, list(range(-(-n // BLOCK))), 1)]
    raise ConfigError(f"shape {shape!r}: dN (N decodes) or pN (a prefill of N tokens)")


def blocks_needed(shapes: tuple[str, ...], context: int) -> int:
    need = 1
    for shape in shapes:
        n = int(shape[1:])
        need = max(need, n * -(-(context + 1) // BLOCK) if shape[0] == "d" else -(-n // BLOCK))
    return need


def time_shape(runner: ModelRunner, clock: StageClock, spans: list[Span], trials: int):
    """(ms per step, {stage: ms per step}) over `trials` steps after two warm-ups."""
    greedy = SamplingParams(temperature=0.0)
    rows = [
        SamplingRow(greedy, 0, span.start + 1, span.token_ids, [], None)
        for span in spans
        for _ in range(span.num_logits)
    ]
    sample = clock.wrap("sampling (greedy)", runner.sampler)
    prepare = clock.wrap("step tensors (host)", runner._prepare)
    for _ in range(2):
        runner.forward(spans)
    clock.seconds.clear()
    start = clock.now()
    for _ in range(trials):
        input_ids, positions, meta, logits_rows = prepare(spans)
        logits = runner.model.forward(
            input_ids, positions, meta, runner.kv_cache.layers, logits_rows
        )
        sample(logits, rows)
    total = clock.now() - start
    stages = {name: s * 1e3 / trials for name, s in clock.seconds.items()}
    stages["rest (glue, embedding)"] = total * 1e3 / trials - sum(stages.values())
    return total * 1e3 / trials, stages


def run_step_bench(cfg: StepBenchConfig) -> None:
    torch.set_num_threads(cfg.threads)
    blocks = blocks_needed(cfg.shapes, cfg.context)
    engine_config = EngineConfig(
        model_dir=cfg.model_dir,
        dtype=cfg.dtype,
        device="cpu",
        num_kv_blocks=blocks,
        block_size=BLOCK,
        attention_backend=cfg.attention_backend,
        group_quant_activations=cfg.group_quant_activations,
    )
    model_config = ModelConfig.from_dir(cfg.model_dir)
    longest = max([cfg.context + 1] + [int(s[1:]) for s in cfg.shapes if s[0] == "p"])
    runner = ModelRunner(engine_config, model_config, blocks, longest + 256)
    clock = StageClock(time.thread_time if cfg.threads == 1 else time.perf_counter)
    kind = "thread CPU time" if cfg.threads == 1 else "wall time"
    print(
        f"{cfg.model_dir.name} {cfg.dtype}, per-row ops: {runner.model.ops.path}, "
        f"kept-quantized activations: {cfg.group_quant_activations}; "
        f"ms per step ({kind}, {cfg.threads} thread(s), mean of {cfg.trials})"
    )
    instrument(runner, clock)
    for shape in cfg.shapes:
        total, stages = time_shape(runner, clock, spans_of(shape, cfg.context), cfg.trials)
        print(f"\n{shape}: {total:.2f} ms/step")
        for name, ms in sorted(stages.items(), key=lambda kv: -kv[1]):
            read = clock.bytes.get(name, 0)
            rate = f"  {read / 1e6:8.1f} MB  {read / ms / 1e6:6.2f} GB/s" if read and ms else ""
            print(f"  {name:24s} {ms:8.2f}  {100 * ms / total:5.1f}%{rate}")
