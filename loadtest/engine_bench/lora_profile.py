"""`splitserve bench lora`'s clocks: where one run's time goes, measured by wrapping the
engine's pieces for the length of that run (they are timed, never changed).

Per run: the model's forward passes, decode-only steps apart from steps with prompt rows;
on a LoRA engine, the bank's `begin_step` (each row's slot, and any slot filled), its
`add_products` (the Python from `model/decoder.linear` to the kernel, with the kernel) and
`StackedPair.add` alone (the stacked products: csrc/cpu/lora_products.cpp's `lora_add`, and
its argument checks). The one rule: every wrapper comes off when the run ends (`clocked`
is a context manager), so a run never pays for another's clocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from shared.engine.engine import LLMEngine
from shared.engine.lora.stacked import StackedPair


@dataclass(slots=True)
class RunClock:
    """Seconds of one run, and of its pieces."""

    seconds: float = 0.0  # the whole run (requests added to the last token)
    tokens: int = 0  # output tokens
    decode_s: float = 0.0  # forward passes of steps with only decode rows
    decode_steps: int = 0
    prompt_s: float = 0.0  # forward passes of steps with prompt rows
    prompt_steps: int = 0
    begin_step_s: float = 0.0  # the bank's begin_step
    add_products_s: float = 0.0  # the bank's add_products, the kernel in it
    kernel_s: float = 0.0  # StackedPair.add
    kernel_decode_s: float = 0.0  # of kernel_s, in decode-only steps
    in_decode: bool = False  # the step running now has only decode rows

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def steps(self) -> int:
        return self.decode_steps + self.prompt_steps

    @property
    def python_s(self) -> float:
        """add_products' own Python around the kernel calls."""
        return self.add_products_s - self.kernel_s


@contextmanager
def clocked(engine: LLMEngine) -> Iterator[RunClock]:
    """Time `engine`'s pieces until the block ends (`seconds` and `tokens` are the caller's)."""
    clock = RunClock()
    runner, bank = engine.runner, engine.adapters
    forward = runner.forward

    def timed_forward(spans: list[Any]):
        clock.in_decode = all(len(span.token_ids) == 1 for span in spans)
        started = time.perf_counter()
        try:
            return forward(spans)
        finally:
            spent = time.perf_counter() - started
            if clock.in_decode:
                clock.decode_s += spent
                clock.decode_steps += 1
            else:
                clock.prompt_s += spent
                clock.prompt_steps += 1

    add = StackedPair.add

    def timed_add(pair: StackedPair, *args: Any):
        started = time.perf_counter()
        try:
            return add(pair, *args)
        finally:
            spent = time.perf_counter() - started
            clock.kernel_s += spent
            if clock.in_decode:
                clock.kernel_decode_s += spent

    runner.forward = timed_forward  # type: ignore[method-assign]
    StackedPair.add = timed_add  # type: ignore[method-assign]
    if bank is not None:
        bank.begin_step = _adding(bank.begin_step, clock, "begin_step_s")  # type: ignore[method-assign]
        bank.add_products = _adding(bank.add_products, clock, "add_products_s")  # type: ignore[method-assign]
    try:
        yield clock
    finally:
        del runner.forward
        StackedPair.add = add  # type: ignore[method-assign]
        if bank is not None:
            del bank.begin_step, bank.add_products


def _adding(call: Callable[..., Any], clock: RunClock, field: str) -> Callable[..., Any]:
    """`call`, adding the seconds spent in it to `clock.<field>`."""

    def timed(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            setattr(clock, field, getattr(clock, field) + time.perf_counter() - started)

    return timed
