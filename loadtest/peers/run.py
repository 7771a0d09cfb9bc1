"""`splitserve bench peers` (`make bench-peers`): `splitserve up` beside vLLM-CPU and llama.cpp.

One invocation, one machine, servers taking turns (figures.plan_turns): each turn
starts one server alone, sends two warm-up requests, then for every concurrency the same
workload through the loadtest harness: `num_prompts` prompts of `input_words` random words
→ `output_len` tokens (ignore_eos), one streaming client, all queued at once and capped at
the concurrency; then the server is stopped. Each run writes its JSON and PNG like `bench
serve`; the whole comparison goes to peers.json and peers.png. Then offline throughput:
our engine against vLLM's `LLM.generate` (offline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from loadtest.engine_bench.machine_share import (
    BF16_BYTES,
    MachinePeaks,
    ModelWork,
    ServerFigures,
    format_shares,
    kept_step_bytes,
    shares,
)
from loadtest.peers.config import PeersConfig, Server
from loadtest.peers.figures import (
    OURS,
    OURS_VLLM,
    Headline,
    RunFigures,
    Turn,
    format_summary,
    headlines,
    medians,
    plan_turns,
    ratios,
)
from loadtest.peers.offline import OfflineResult
from loadtest.peers.prepare import prepare_peers
from shared.engine.model.checkpoint import quantized_formats
from shared.engine.model_config import ModelConfig, cpu_runs_bf16

if TYPE_CHECKING:
    from loadtest.request import BenchRequest


def word_requests(num: int, words: int, output_len: int, seed: int) -> list[BenchRequest]:
    """`num` prompts of `words` random words each (the chat scenarios' word list); their
    token count is estimated at 1.28 a word, and the servers' usage reports the real one."""
    from loadtest.request import BenchRequest
    from loadtest.scenarios import words as random_words

    rng = random.Random(seed)
    text = [random_words(rng, words) for _ in range(num)]
    return [BenchRequest(t, round(words * 1.28), output_len, label="words") for t in text]


def _run_turn(cfg: PeersConfig, turn: Turn, server: Server) -> list[RunFigures]:
    from loadtest.client import ClientConfig
    from loadtest.metrics import summarize
    from loadtest.openloop import OpenLoopConfig, run_open_loop
    from loadtest.outputs import discover_model
    from loadtest.plot import write_png
    from loadtest.report import result_json, write_json

    client = ClientConfig(server.url, discover_model(server.url))
    warmup = word_requests(2, cfg.input_words, 8, seed=99)
    asyncio.run(run_open_loop(client, OpenLoopConfig(show_progress=False), warmup))
    figures = []
    for c in cfg.concurrencies:
        requests = word_requests(cfg.prompts_at(c), cfg.input_words, cfg.output_len, seed=c)
        loop = OpenLoopConfig(max_concurrency=c, show_progress=False)
        run = asyncio.run(run_open_loop(client, loop, requests))
        summary = summarize(run.records, run.duration)
        stem = cfg.out / f"{turn.server}-r{turn.round}-c{c}"
        config = {"mode": "open-loop", "server": turn.server, "round": turn.round,
                  "max_concurrency": c, "client": asdict(client)}  # fmt: skip
        write_json(stem.with_suffix(".json"), result_json(config, summary, run))
        write_png(stem.with_suffix(".png"), f"{turn.server} round {turn.round} c={c}", run, summary)
        figures.append(RunFigures.of(turn, c, summary))
        print(figures[-1].line(), flush=True)
    return figures


def _bytes_per_value(server: str, up_args: tuple[str, ...]) -> int:
    """What a weight or KV value of `server` takes: our mesh's dtype from its flags, or `auto`
    on this CPU (bf16 where the kernels have AVX2, else fp32); bf16 for the peers, as run."""
    if server != OURS:
        return BF16_BYTES
    flags = argparse.ArgumentParser(add_help=False)  # `up` parses its flags with argparse too
    flags.add_argument("--dtype", default="auto")
    dtype = flags.parse_known_args(list(up_args))[0].dtype
    if dtype == "auto":
        dtype = "bfloat16" if cpu_runs_bf16() else "float32"
    return BF16_BYTES if dtype in ("bfloat16", "float16") else 4


def _server_figures(
    server: str,
    runs: list[RunFigures],
    medians_of: dict[str, float],
    marks: tuple[Headline, ...],
    cfg: PeersConfig,
    offline: OfflineResult | None,
) -> ServerFigures:
    """A server's headline medians and its requests' mean size, for `machine_share`."""
    mine = [r for r in runs if r.server == server and r.completed]
    completed = sum(r.completed for r in mine) or 1
    offline_tok_s = None
    if offline and server in (OURS, "vllm"):
        offline_tok_s = offline.ours_tok_s if server == OURS else offline.vllm_tok_s
    name_of = {mark.field: mark.name for mark in marks}  # headlines(): one mark per field
    return ServerFigures(
        prompt_len=sum(r.input_tokens for r in mine) / completed,
        output_len=sum(r.output_tokens for r in mine) / completed,
        output_tok_s=medians_of.get(name_of["output_tok_s"]),
        tpot_ms=medians_of.get(name_of["tpot_p50_ms"]),
        offline_tok_s=offline_tok_s,
        offline_lens=(cfg.offline.input_len, cfg.offline.output_len) if cfg.offline else (0, 0),
    )


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def run_peers_bench(cfg: PeersConfig) -> dict[str, object]:
    # SIGTERM (a timeout, a CI stop) unwinds like Ctrl-C, so every server started is stopped.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    model_dir = cfg.model_dir
    if model_dir is None:
        from shared.models.pull import pull_model

        # vLLM loads the float32 copy (and splitserve then serves that one too)
        vllm = {"vllm", OURS_VLLM} & set(cfg.servers)
        model_dir = pull_model(cfg.model, keep_quant=False if vllm else None)
    peers = prepare_peers(cfg, model_dir)
    servers = tuple(s for s in cfg.servers if s == OURS or s in peers.ready)
    load_before = os.getloadavg()[0]
    cpus = peers.cpus
    print(f"{len(cpus)} CPUs ({peers.cpu_list}); load average {load_before:.2f}; "
          f"servers {', '.join(servers)}; {cfg.rounds} round(s)")  # fmt: skip
    machine = MachinePeaks.measure(len(cpus))  # before any server starts: the quiet machine
    if machine:
        print(machine.line())
    for name, reason in peers.skipped.items():
        print(f"{name} skipped: {reason}")
    runs: list[RunFigures] = []
    for turn in plan_turns(servers, cfg.rounds):
        server = peers.start(turn, model_dir)
        started = time.monotonic()
        try:
            server.wait_ready(cfg.start_timeout_s)
            print(f"round {turn.round} {turn.server}: ready in {time.monotonic() - started:.0f} s")
            runs += _run_turn(cfg, turn, server)
        finally:
            server.stop()
    marks = headlines(cfg.concurrencies)
    by_server = medians(runs, marks)
    peer_ratios = ratios(by_server)
    print(format_summary(by_server, peer_ratios, marks))
    offline = peers.offline(model_dir) if cfg.offline and "vllm" in peers.ready else None
    if offline:
        print(offline.line())
    machine_shares = {}
    if machine:
        model = ModelConfig.from_dir(model_dir)
        kept = kept_step_bytes(model_dir) if quantized_formats(model_dir) else 0
        for server in by_server:
            figures = _server_figures(server, runs, by_server[server], marks, cfg, offline)
            work = ModelWork.of(model, _bytes_per_value(server, cfg.up_args), kept)
            machine_shares[server] = shares(figures, work, machine)
        print(format_shares(machine_shares, machine, cfg.concurrencies))
    for name, reason in peers.skipped.items():
        print(f"{name} skipped: {reason}")
    print(f"load average before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")
    result = {
        "config": asdict(cfg),
        "machine": {
            "cpus": cpus,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "peaks": machine and asdict(machine),
        },
        "machine_shares": machine_shares,
        "skipped": peers.skipped,
        "runs": [asdict(r) for r in runs],
        "medians": by_server,
        "ratios": peer_ratios,
        "offline": offline and offline.as_json(),
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "peers.json").write_text(json.dumps(result, indent=1, default=str))
    from loadtest.peers.plot import write_peers_png

    write_peers_png(cfg.out / "peers.png", runs, marks, by_server, offline)
    print(f"wrote {cfg.out / 'peers.json'} and {cfg.out / 'peers.png'}")
    return result
