"""What a vLLM engine's start log says of its compile: whether it compiled the model, loaded
what an earlier start compiled, or failed to load that and compiled again, and how long its
engine core took to init (vLLM's "init engine (profile, create kv cache, warmup model)":
the compile or the load, the profile run and the warm-up; not the weights).

The subtle rule: a log holds every vLLM start that wrote to it (a restarted worker's too);
the last start's lines are the ones read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum

START = "Initializing a V1 LLM engine"
INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
WARMUP = re.compile(r"Initial profiling/warmup run took ([\d.]+) s")


class CompileCache(IntEnum):
    EAGER = 0  # no compile in the log (--no-vllm-compile, or not a vLLM log)
    COMPILED = 1  # compiled and saved, nothing there to load
    LOADED = 2  # loaded what an earlier start compiled
    LOAD_FAILED = 3  # found an earlier start's, failed to load it, compiled again


@dataclass(frozen=True, slots=True)
class VllmCompile:
    cache: CompileCache = CompileCache.EAGER
    init_s: float = 0.0  # the engine core's init: compile or load, profile run, warm-up
    warmup_s: float = 0.0  # of which the first run of the compiled model


def read_compile(log_text: str) -> VllmCompile:
    """The last vLLM start's compile in `log_text`."""
    text = log_text[log_text.rfind(START) :] if START in log_text else log_text
    if "Compiling model again due to a load failure" in text:
        cache = CompileCache.LOAD_FAILED
    elif "Directly load AOT compilation from path" in text:
        cache = CompileCache.LOADED
    elif "saved AOT compiled function" in text:
        cache = CompileCache.COMPILED
    else:
        cache = CompileCache.EAGER
    return VllmCompile(cache, _seconds(INIT_ENGINE, text), _seconds(WARMUP, text))


def _seconds(pattern: re.Pattern[str], text: str) -> float:
    found = pattern.findall(text)
    return float(found[-1]) if found else 0.0


WHAT = {
    CompileCache.EAGER: "vLLM ran eagerly",
    CompileCache.COMPILED: "vLLM compiled the model",
    CompileCache.LOADED: "vLLM loaded the compiled model",
    CompileCache.LOAD_FAILED: "vLLM failed to load the compiled model and compiled it again",
}


def describe_compile(compiled: VllmCompile) -> str:
    if not compiled.init_s:
        return ""
    init = f"its engine init {compiled.init_s:.1f}s (warm-up run {compiled.warmup_s:.1f}s)"
    return f"{WHAT[compiled.cache]}; {init}"
