"""`python -m loadtest.engine_bench.tier_ab`: the KV tier's cost and gain at the engine, its
variants interleaved in one process: every variant's engine serves the same slice of the
workload (a few requests) in turn, the order rotating, so a loaded machine's changes fall
on all of them alike (compare the ratios; the seconds move with the load).

Workloads, as docs/kv_tier.md's `bench serve` runs but without HTTP: `no-reuse` (random
prompts) and `multi-turn` (loadtest/datasets.py), `concurrency` requests in flight within a
slice. Each variant has its own engine (pool and tier) for the whole workload. Variants:
`off` (no tier), `on` (the tier as shipped: it writes once evicted blocks return,
admission.py) and `all` (every evicted block written: what writing costs). After its slice
an engine's writer is waited for, and that wait counts in its seconds (its writes never
slow another variant's slice). The engine's step costs are fed back as the worker's engine
thread does (StepTimer). Printed per variant: seconds, CPU seconds of the process in its
slices, TTFT mean / p50 / p99 and TPOT mean in ms, the tier's blocks loaded (read ahead, ms
a block in the step), late, skipped, written and left unwritten; then the step clocks: the
median ms of a decode-only step and of a step that mixes a prompt chunk with decode rows,
and the mean ms a step spends outside the model's forward pass (scheduling, the block
manager and the tier's hooks: what a tier without reuse adds to a step, if anything); then
the ratios to `off`.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.datasets import DatasetConfig, multi_turn_requests, random_requests
from loadtest.request import BenchRequest
from services.worker.step_costs import StepTimer
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.kv_tier.admission import WriteAdmission
from shared.engine.kv_tier.tier_stats import TierStats
from shared.engine.outputs import StepOutput
from shared.engine.sampler import SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import ScheduledChunk

MODEL_DIR = Path.home() / ".cache/splitserve/models/smollm2-135m-instruct"


class WriteAll(WriteAdmission):
    """Every evicted block written, returns or not (the `all` variant)."""

    def admit(self, hashes: list[int]) -> list[bool]:
        return [True] * len(hashes)


def write_all(engine: LLMEngine) -> None:
    assert engine.tier is not None
    engine.tier.admission = WriteAll(1, 0)


Variant = tuple[float, Callable[[LLMEngine], None] | None]  # tier GiB, then an adjustment
VARIANTS: dict[str, Variant] = {"off": (0.0, None), "on": (2.0, None), "all": (2.0, write_all)}


@dataclass(slots=True)
class Run:
    workload: str
    variant: str
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    ttft_by_label: dict[str, list[float]] = field(default_factory=dict)
    tpot: list[float] = field(default_factory=list)
    tier: TierStats = field(default_factory=TierStats)
    written: int = 0  # blocks
    decode_steps: list[float] = field(default_factory=list)  # seconds, no prompt token
    mixed_steps: list[float] = field(default_factory=list)  # seconds, prompt and decode rows
    host_seconds: float = 0.0  # in steps, outside the model's forward pass
    steps: int = 0

    def line(self) -> str:
        ttft = self.ttft
        return (
            f"{self.workload:10} {self.variant:4} {self.seconds:7.1f} s"
            f"  cpu {self.cpu_seconds:6.1f} s"
            f"  TTFT {1e3 * statistics.mean(ttft):6.0f} / {1e3 * statistics.median(ttft):6.0f}"
            f" / {1e3 * _p99(ttft):6.0f} ms  TPOT {1e3 * statistics.mean(self.tpot):5.1f} ms"
            f"  tier: {self.tier.hits} loaded ({self.tier.prefetched} read ahead,"
            f" {1e3 * self.tier.load_seconds / max(1, self.tier.hits):.2f} ms a block),"
            f" {self.tier.late} late, {self.tier.skipped} skipped, {self.written} written,"
            f" {self.tier.unwritten} unwritten"
        )

    def step_line(self) -> str:
        """The step clocks: decode-only and mixed steps' median ms, host ms a step."""
        return (
            f"    steps: decode {_median_ms(self.decode_steps)} ms"
            f" ({len(self.decode_steps)}), mixed {_median_ms(self.mixed_steps)} ms"
            f" ({len(self.mixed_steps)}), host {1e3 * self.host_seconds / max(1, self.steps):.3f}"
            " ms a step"
        )

    def turns(self) -> str:
        """TTFT p50 by label (a multi-turn run's turns), in ms."""
        return "  ".join(
            f"{label.split()[-1]} {1e3 * statistics.median(values):.0f}"
            for label, values in self.ttft_by_label.items()
        )


def prompts(workload: str, args: argparse.Namespace, seed: int) -> list[BenchRequest]:
    common = {"vocab_size": 49000, "output_len": args.output_len, "seed": seed}
    if workload == "no-reuse":
        cfg = DatasetConfig("random", args.no_reuse_prompts, input_len=512, **common)
        return random_requests(cfg)
    cfg = DatasetConfig(
        "multi-turn",
        args.conversations * args.turns,
        input_len=64,
        prefix_len=512,
        num_turns=args.turns,
        **common,
    )
    return multi_turn_requests(cfg)


@dataclass(slots=True)
class Bench:
    """One variant's engine, its step timer, and what it measured."""

    engine: LLMEngine
    run: Run
    timer: StepTimer = field(default_factory=StepTimer)
    forward_seconds: float = 0.0  # in the model runner, since start

    def __post_init__(self) -> None:
        run_model = self.engine.runner.run

        def timed(chunks: list[ScheduledChunk]) -> list[list[SampledToken]]:
            began = time.perf_counter()  # the forward pass's clock, apart from the step's
            try:
                return run_model(chunks)
            finally:
                self.forward_seconds += time.perf_counter() - began

        self.engine.runner.run = timed


def serve(bench: Bench, requests: list[tuple[int, BenchRequest]], args: argparse.Namespace):
    """Serve `requests` in order, `args.concurrency` at a time, until all are done; TTFT and
    TPOT of each, then wait for the tier's writes (counted in the slice's seconds)."""
    engine, run = bench.engine, bench.run
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    added: dict[str, float] = {}  # in flight: when it was added
    first: set[str] = set()  # in flight with its first token
    labels = {str(index): request.label for index, request in requests}
    pending = list(requests)
    cpu_before = _cpu_seconds()
    began = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(added) < args.concurrency:
            index, request = pending.pop(0)
            engine.add_request(str(index), list(request.prompt), params)
            added[str(index)] = time.perf_counter()
        forward_before = bench.forward_seconds
        step_began = time.perf_counter()
        step = engine.run_step()
        now = time.perf_counter()
        bench.timer.observe(now - step_began, step.num_prompt_tokens, step.num_decode_rows)
        _clock_step(run, now - step_began, bench.forward_seconds - forward_before, step)
        engine.observe_costs(bench.timer.current)
        for out in step.outputs:
            rid = out.request_id
            if out.new_token_ids and rid not in first:
                first.add(rid)
                run.ttft.append(now - added[rid])
                run.ttft_by_label.setdefault(labels[rid], []).append(now - added[rid])
                added[rid] = now  # from here: its decode
            if out.finish_reason is not None:
                if args.output_len > 1:
                    run.tpot.append((now - added[rid]) / (args.output_len - 1))
                del added[rid]
                first.discard(rid)
    if engine.tier is not None:
        engine.tier.writer.flush(timeout=60)
    run.seconds += time.perf_counter() - began
    run.cpu_seconds += _cpu_seconds() - cpu_before


def _clock_step(run: Run, seconds: float, forward: float, step: StepOutput) -> None:
    run.steps += 1
    run.host_seconds += seconds - forward
    if step.num_decode_rows and not step.num_prompt_tokens:
        run.decode_steps.append(seconds)
    elif step.num_decode_rows:
        run.mixed_steps.append(seconds)


def _median_ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.1f}" if values else "-"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_bench(workload: str, variant: str, args: argparse.Namespace, tier_dir: str) -> Bench:
    size, adjust = VARIANTS[variant]
    config = EngineConfig(
        model_dir=args.model_dir,
        num_kv_blocks=args.num_kv_blocks,
        kv_offloading_size=size,
        kv_offloading_dir=tier_dir,
    )
    engine = LLMEngine(config)
    if adjust is not None:
        adjust(engine)
    return Bench(engine, Run(workload, variant))


def interleaved(workload: str, args: argparse.Namespace) -> list[Run]:
    """Every variant serves the workload, slice by slice in turn; their runs."""
    variants = args.variants.split(",")
    requests = list(enumerate(prompts(workload, args, seed=1)))
    with tempfile.TemporaryDirectory(prefix="tier-ab.") as tier_dir:
        benches = [make_bench(workload, v, args, tier_dir) for v in variants]
        for turn, start in enumerate(range(0, len(requests), args.slice)):
            order = benches[turn % len(benches) :] + benches[: turn % len(benches)]
            for bench in order:
                serve(bench, requests[start : start + args.slice], args)
        for bench in benches:
            bench.run.tier = bench.engine.stats().tier
            tier = bench.engine.tier
            bench.run.written = bench.run.tier.bytes_out // tier.layout.entry_bytes if tier else 0
            bench.engine.close()
    return [bench.run for bench in benches]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--workloads", default="no-reuse,multi-turn")
    parser.add_argument("--variants", default="off,on,all")
    parser.add_argument("--num-kv-blocks", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--no-reuse-prompts", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--slice", type=int, default=4, help="requests a variant serves in turn")
    args = parser.parse_args(argv)
    for workload in args.workloads.split(","):
        runs = interleaved(workload, args)
        for run in runs:
            print(run.line(), flush=True)
            print(run.step_line(), flush=True)
            if len(run.ttft_by_label) > 1:
                print(f"    TTFT p50 by turn: {run.turns()}", flush=True)
        base = runs[0]
        for run in runs[1:]:
            print(
                f"{workload:10} {run.variant}/{base.variant}: seconds "
                f"{run.seconds / base.seconds:.2f}x  TTFT mean "
                f"{statistics.mean(run.ttft) / statistics.mean(base.ttft):.2f}x  p50 "
                f"{statistics.median(run.ttft) / statistics.median(base.ttft):.2f}x  p99 "
                f"{_p99(run.ttft) / _p99(base.ttft):.2f}x  TPOT "
                f"{statistics.mean(run.tpot) / statistics.mean(base.tpot):.2f}x  decode step "
                f"{_ratio(run.decode_steps, base.decode_steps)}  mixed step "
                f"{_ratio(run.mixed_steps, base.mixed_steps)}",
                flush=True,
            )


def _ratio(values: list[float], base: list[float]) -> str:
    if not values or not base:
        return "-"
    return f"{statistics.median(values) / statistics.median(base):.2f}x"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
