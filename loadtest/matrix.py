"""`make bench`'s serving matrix: the real mesh under the standard open-loop workload.

For the disaggregated mesh (1 prefill + 1 decode) and the aggregated one (`--aggregated`):
`num_prompts` random 128-token prompts → 128 output tokens (ignore_eos), all queued at once
and capped at each concurrency. Then, on a fresh disaggregated mesh, a prefix-cache pair one
request at a time: prompts sharing a 512-token prefix vs unrelated prompts of equal length.
Prints one table next to llama-server's figures for the same workload (ANCHORS.md).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from loadtest.client import ClientConfig
from loadtest.datasets import DatasetConfig, load_dataset
from loadtest.mesh import MeshProcess
from loadtest.metrics import Summary
from loadtest.openloop import OpenLoopConfig, run_open_loop
from loadtest.outputs import finish_run
from shared.models.registry import DEFAULT_MODEL

# (name, `splitserve up` flags, runs): each on a fresh mesh, so one failure does not spread
MESHES = (
    ("disaggregated", [], "standard"),
    ("aggregated", ["--aggregated"], "standard"),
    ("prefix-cache", [], "prefix"),
)
# llama-server -t 2 -np 8, F32, same workload: (TTFT mean ms, TPOT ms, output tok/s)
LLAMA_SERVER_F32 = {1: (235, 25.6, 36.7), 4: (923, 54.7, 65.1), 8: (1796, 63.4, 104.0),
                    16: (9344, 64.3, 102.4)}  # fmt: skip


@dataclass(slots=True, frozen=True)
class MatrixConfig:
    model: str = DEFAULT_MODEL
    model_dir: Path | None = None
    out: Path = Path("artifacts/loadtest")
    num_prompts: int = 32
    concurrencies: tuple[int, ...] = (1, 4, 8, 16)
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 512
    prefix_concurrency: int = 1  # one at a time: TTFT without queueing
    prefix_output_len: int = 16


def _run(url: str, model: str, dataset: DatasetConfig, conc: int, label: str, out: Path) -> Summary:
    client = ClientConfig(url, model)
    loop = OpenLoopConfig(max_concurrency=conc)
    run = asyncio.run(run_open_loop(client, loop, load_dataset(dataset), label))
    config = {"mode": "open-loop", "dataset": dataset.name, "max_concurrency": conc}
    return finish_run(label, config, run, {}, out)


def _mesh_runs(cfg: MatrixConfig, mesh: str, runs: str, url: str, vocab: int) -> dict[str, Summary]:
    def dataset(
        name: str, num: int, input_len: int, output_len: int, seed: int = 0
    ) -> DatasetConfig:
        return DatasetConfig(name, num, input_len, output_len, vocab, cfg.prefix_len, 1, seed=seed)

    warmup = dataset("random", 2, cfg.input_len, 8, seed=99)
    _run(url, cfg.model, warmup, 2, f"{mesh}-warmup", cfg.out)
    if runs == "standard":
        standard = dataset("random", cfg.num_prompts, cfg.input_len, cfg.output_len)
        return {
            f"{mesh} c={c}": _run(url, cfg.model, standard, c, f"{mesh}-c{c}", cfg.out)
            for c in cfg.concurrencies
        }
    c, n, out_len = cfg.prefix_concurrency, cfg.num_prompts, cfg.prefix_output_len
    unshared = dataset("random", n, cfg.prefix_len + cfg.input_len, out_len, seed=7)
    shared = dataset("shared-prefix", n, cfg.input_len, out_len)
    return {
        f"no shared prefix c={c}": _run(url, cfg.model, unshared, c, "unshared", cfg.out),
        f"shared prefix c={c}": _run(url, cfg.model, shared, c, "shared-prefix", cfg.out),
    }


def format_matrix(rows: dict[str, Summary]) -> str:
    head = (
        "| run | TTFT mean ms | TTFT p99 ms | TPOT mean ms | ITL p99 ms | output tok/s | errors |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name, s in rows.items():
        figures = (s.ttft.mean, s.ttft.p99, s.tpot.mean, s.itl.p99, s.output_throughput)
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in figures) + f" | {s.failed} |")
    for c, (ttft, tpot, tok_s) in LLAMA_SERVER_F32.items():
        lines.append(f"| llama-server F32 c={c} (ANCHORS.md) | {ttft} | | {tpot} | | {tok_s} | |")
    return "\n".join(lines)


def run_matrix(cfg: MatrixConfig) -> dict[str, Summary]:
    from shared.models.pull import pull_model

    model_dir = cfg.model_dir or pull_model(cfg.model, keep_quant=False)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    load_before = os.getloadavg()[0]
    rows: dict[str, Summary] = {}
    for name, extra, runs in MESHES:
        mesh = MeshProcess(model_dir, extra, cfg.out / f"{name}-up.log")
        try:
            mesh.wait_ready()
            rows |= _mesh_runs(cfg, name, runs, mesh.url, vocab)
        finally:
            mesh.stop()
    load = f"load average (1 min) before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}"
    table = format_matrix(rows) + "\n\n" + load
    print(table)
    (cfg.out / "matrix.md").write_text(table + "\n")
    return rows
