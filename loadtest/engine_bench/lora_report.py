"""What `splitserve bench lora` prints from its rounds: output tok/s per round and their
medians, where the adapter runs' time goes (lora_profile.py's clocks), and the floor the
adapters' bytes set.

The one rule: each round runs the plain engine (no LoRA: the base model alone), the LoRA
engine's base rows, then its adapter rows, one after the other, so a ratio compares runs
made seconds apart; the ratios are taken per round, then their median.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from loadtest.engine_bench.lora_profile import RunClock
from loadtest.engine_bench.quant import BANDWIDTH


@dataclass(slots=True, frozen=True)
class Round:
    plain: RunClock  # the engine without LoRA
    base: RunClock  # the LoRA engine, every request of the base model
    lora: RunClock  # the LoRA engine, the requests spread over the adapters


def print_rounds(rounds: list[Round], adapters: int) -> None:
    print("round     plain  LoRA base  adapters  adapters/plain  adapters/LoRA base  (tok/s)")
    for i, r in enumerate(rounds, 1):
        print(f"{i:5} {_row(r.plain.tok_s, r.base.tok_s, r.lora.tok_s)}")
    plain, base, lora = (median(getattr(r, k).tok_s for r in rounds) for k in Round.__slots__)
    ratio = median(r.lora.tok_s / r.plain.tok_s for r in rounds)
    print(f"median {_row(plain, base, lora)}")
    print(f"base alone        {plain:8.1f} output tok/s  (the plain engine)")
    print(f"over {adapters} adapters  {lora:8.1f} output tok/s  ({ratio:.2f}x the base)")
    _print_profile(rounds)


def print_floor(rounds: list[Round], slot_bytes: int, adapters_per_step: int) -> None:
    """What the adapters' bytes cost a decode step at the machine's bandwidth (quant.py's
    BANDWIDTH), against the plain engine's decode step: the best ratio at decode."""
    read = slot_bytes * adapters_per_step
    read_ms = read / BANDWIDTH * 1000
    plain_ms = median(_per_step(r.plain.decode_s, r.plain.decode_steps) for r in rounds)
    lora_ms = median(_per_step(r.lora.decode_s, r.lora.decode_steps) for r in rounds)
    best, measured = plain_ms / (plain_ms + read_ms), plain_ms / lora_ms
    print(f"floor: {adapters_per_step} adapters x {slot_bytes / 1e6:.1f} MB = {read / 1e6:.0f} MB "
          f"a decode step, {read_ms:.1f} ms at {BANDWIDTH / 1e9:.1f} GB/s; a decode step "
          f"{plain_ms:.1f} ms plain, {lora_ms:.1f} ms over the adapters: "
          f"{best:.2f}x at best, {measured:.2f}x measured")  # fmt: skip


def _print_profile(rounds: list[Round]) -> None:
    """Per step (ms, all rounds' steps together) for the three runs; then the adapter runs'
    extra seconds over the LoRA engine's base rows, split."""
    runs = {k: [getattr(r, k) for r in rounds] for k in Round.__slots__}
    print("ms a step (all rounds)           plain  LoRA base  adapters")
    lines = {
        "forward, decode-only steps": lambda c: _per_step(c.decode_s, c.decode_steps),
        "forward, steps with prompt rows": lambda c: _per_step(c.prompt_s, c.prompt_steps),
        "outside forward (schedule, sample)": lambda c: _per_step(
            c.seconds - c.decode_s - c.prompt_s, c.steps
        ),
        "  products, decode-only steps": lambda c: _per_step(c.kernel_decode_s, c.decode_steps),
        "  products, steps with prompt rows": lambda c: _per_step(
            c.kernel_s - c.kernel_decode_s, c.prompt_steps
        ),
        "  Python from linear to the kernel": lambda c: _per_step(c.python_s, c.steps),
        "  rows' slots (begin_step)": lambda c: _per_step(c.begin_step_s, c.steps),
    }
    for label, of in lines.items():
        cells = (sum(of(c) for c in clocks) / len(clocks) for clocks in runs.values())
        print(f"{label:34} " + " ".join(f"{cell:9.2f}" for cell in cells))
    lora = runs["lora"]
    total = sum(c.seconds for c in lora)
    extra = total - sum(c.seconds for c in runs["base"])
    kernel = sum(c.kernel_s for c in lora)
    python = sum(c.python_s for c in lora)
    begin = sum(c.begin_step_s for c in lora)
    rest = extra - kernel - python - begin
    print(f"adapter runs' extra over the base rows: {extra:.2f} s ({100 * extra / total:.1f}% of "
          f"their time): products {kernel:.2f} s, Python around them {python:.2f} s, "
          f"begin_step {begin:.2f} s, the rest {rest:.2f} s")  # fmt: skip
    base = sum(c.seconds for c in runs["base"]) / sum(c.seconds for c in runs["plain"]) - 1
    print(
        f"the LoRA engine's base rows against the plain engine: {100 * base:+.1f}% time "
        "(the plain engine's path: the bank's step bookkeeping, else noise)"
    )
    print(f"adapter products: {100 * kernel / total:.1f}% of the adapter run's time")


def _row(plain: float, base: float, lora: float) -> str:
    return f"{plain:9.1f} {base:10.1f} {lora:9.1f} {lora / plain:15.2f} {lora / base:19.2f}"


def _per_step(seconds: float, steps: int) -> float:
    return 1000 * seconds / steps if steps else 0.0
