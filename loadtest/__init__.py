"""Load harness for any OpenAI-compatible endpoint.

Open loop like `vllm bench serve` (`python -m loadtest serve`): requests from a dataset
arrive at a gamma-distributed rate, optionally capped by a concurrency limit.
Closed loop like Locust (`python -m loadtest users`): N users run weighted tasks with
wait times. Both stream with `stream_options.include_usage` and measure with vLLM's
definitions (see `metrics.py`); results go to a terminal table, a JSON file and a PNG.
`splitserve bench` (bench_cli.py) runs these and the benchmarks of engine_bench/ (the
engine in-process), mesh_bench/ (through `splitserve up`) and peers/ (beside vLLM, llama.cpp).
"""
