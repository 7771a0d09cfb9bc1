"""`bench start`'s reading of a vLLM worker's log (loadtest/vllm_compile_log.py): compiled,
loaded or failed to load, and the engine init's seconds, of the last start in the log."""

from __future__ import annotations

from loadtest.vllm_compile_log import CompileCache, VllmCompile, describe_compile, read_compile

CACHE = "/home/vllm/torch_compile_cache/torch_aot_compile/9d5e/rank_0_0/model"
STARTED = "(EngineCore pid=793) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with"
CORE = "(EngineCore pid=793)"
SAVED = f"{CORE} INFO [decorators.py:743] [backbone] saved AOT compiled function to {CACHE}"
FAILED = (
    "(EngineCore pid=793) WARNING [decorators.py:333] [backbone] Compiling model again due to a "
    f"load failure from {CACHE}, reason: 'function' object has no attribute 'finalize_loading'"
)
LOADED = (
    f"{CORE} INFO [decorators.py:322] [backbone] Directly load AOT compilation from path {CACHE}"
)


def init(seconds: float, warmup: float) -> str:
    return (
        f"{CORE} INFO [monitor.py:91] [backbone] Initial profiling/warmup run took {warmup:.2f} s\n"
        f"{CORE} INFO [core.py:402] init engine (profile, create kv cache, warmup model) took "
        f"{seconds:.2f} s"
    )


def test_a_first_start_compiles_and_a_next_one_loads():
    compiled = read_compile("\n".join([STARTED, SAVED, init(144.73, 26.03)]))
    assert compiled == VllmCompile(CompileCache.COMPILED, 144.73, 26.03)
    loaded = read_compile("\n".join([STARTED, LOADED, init(12.5, 3.25)]))
    assert loaded == VllmCompile(CompileCache.LOADED, 12.5, 3.25)
    expected = "vLLM loaded the compiled model; its engine init 12.5s (warm-up run 3.2s)"
    assert describe_compile(loaded) == expected


def test_a_failed_load_is_told_apart_from_a_first_compile():
    text = "\n".join([STARTED, FAILED, SAVED, init(112.74, 21.72)])
    assert read_compile(text).cache == CompileCache.LOAD_FAILED


def test_the_last_start_in_the_log_is_the_one_read():
    first = [STARTED, SAVED, init(144.73, 26.03)]
    restarted = [STARTED, LOADED, init(10.0, 2.0)]
    assert read_compile("\n".join(first + restarted)) == VllmCompile(CompileCache.LOADED, 10.0, 2.0)


def test_an_eager_engine_compiled_nothing_and_another_log_says_nothing():
    eager = read_compile("\n".join([STARTED, init(2.89, 0.0).splitlines()[1]]))
    assert eager == VllmCompile(CompileCache.EAGER, 2.89, 0.0)
    assert describe_compile(eager).startswith("vLLM ran eagerly; its engine init 2.9s")
    assert read_compile("INFO native engine up") == VllmCompile()
    assert describe_compile(read_compile("INFO native engine up")) == ""
