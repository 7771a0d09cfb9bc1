"""What share of the machine a benchmark figure is: multiply-adds a second against the
matrix peak, bytes a decode step reads against the memory bandwidth.

Both of the machine's figures are measured on the spot (`MachinePeaks.measure`), before any
server starts:
- the multiply-add peak, for the instruction bf16 runs on (csrc/cpu/peak.cpp: tdpbf16ps
  where AMX tiles run, vdpbf16ps on other AVX512-BF16 hosts, else the fp32 FMA): one core's
  alone, and the sum over the cores this process may use with all of them running it at
  once, which is the machine's (the best of 3). The two differ where the cores share
  execution units: the 2 vCPUs of the CI machine class mostly give twice one core's, but at
  times 142 Gop/s each against 234 alone;
- the read bandwidth: torch's sum over a buffer far larger than the last-level cache on
  every core, the best of a few passes.

The work is the model's (`ModelWork`): 2 ops per multiply-add of the layers' matmuls and
attention for every token computed, of the LM head for every token sampled; a decode step
of one sequence reads every weight its token passes and its context's KV once, in the
server's dtype (bf16: 2 bytes each, as vLLM runs; ours is fp32 where `--dtype auto` picks
it), or for a checkpoint kept quantized the bytes its files hold for those matrices
(`kept_step_bytes`: every tensor but the embedding table's, read a row at a time, unless it is
the head too), which both servers read as the file has them. Part of a small model's weights
stays in the last-level cache from one step to the next, so a decode figure can exceed the
bandwidth: these say how near a server is to the machine, not an exact budget.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from shared.engine.model.checkpoint import checkpoint_files
from shared.engine.model_config import ModelConfig

BF16_BYTES = 2  # a weight or KV value in bf16, vLLM's dtype here
READ_BUFFER_BYTES = 1 << 30
PEAK_ITERATIONS = 50_000_000  # 600M instructions: ~0.2 s on one core


@dataclass(frozen=True, slots=True)
class ModelWork:
    layer_macs: int  # multiply-adds of one token through every layer's matmuls
    head_macs: int  # the LM head's, for a sampled token
    attention_macs_per_context: int  # QK and PV, every layer, per context token attended
    kv_bytes_per_token: int  # K and V of one token, every layer
    bytes_per_value: int = BF16_BYTES  # of a weight or a KV value: 2 for bf16, 4 for fp32
    weight_bytes: int = 0  # a decode step's weights as stored (kept quantized); 0: by dtype

    @classmethod
    def of(
        cls, config: ModelConfig, bytes_per_value: int = BF16_BYTES, weight_bytes: int = 0
    ) -> ModelWork:
        hidden, q, kv = (
            config.hidden_size,
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        attention = hidden * (q + 2 * kv) + q * hidden
        mlp = 3 * hidden * config.intermediate_size  # gate, up, down
        routed = config.num_experts_per_tok * mlp + hidden * config.num_experts
        layers = sum(
            attention + (routed if config.is_moe_layer(i) else mlp)
            for i in range(config.num_layers)
        )
        return cls(
            layer_macs=layers,
            head_macs=config.vocab_size * hidden,
            attention_macs_per_context=2 * config.num_layers * q,
            kv_bytes_per_token=2 * config.num_layers * kv * bytes_per_value,
            bytes_per_value=bytes_per_value,
            weight_bytes=weight_bytes,
        )

    def ops_per_output_token(self, prompt_len: float, output_len: float) -> float:
        """2 per multiply-add: one request's work over its output tokens. The prefill runs
        the prompt through the layers and samples the first token; each later token is one
        decode step."""
        attention = self.attention_macs_per_context
        prefill = prompt_len * self.layer_macs + prompt_len**2 / 2 * attention
        decode_context = prompt_len + output_len / 2
        decodes = (output_len - 1) * (self.layer_macs + decode_context * attention)
        return 2 * (prefill + decodes + output_len * self.head_macs) / output_len

    def decode_step_bytes(self, context: float) -> float:
        """What one sequence's decode step reads: its token's weights and its KV."""
        weights = self.weight_bytes or (self.layer_macs + self.head_macs) * self.bytes_per_value
        return weights + context * self.kv_bytes_per_token


def kept_step_bytes(model_dir: Path) -> int:
    """The bytes a decode step reads of a checkpoint's files: every tensor's, from the
    safetensors headers, but the embedding table's where the head is a tensor of its own."""
    sizes: dict[str, int] = {}
    for path in checkpoint_files(model_dir):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                sizes[name] = entry["data_offsets"][1] - entry["data_offsets"][0]
    own_head = any(name.startswith("lm_head.") for name in sizes)
    embedding = "model.embed_tokens."
    return sum(n for name, n in sizes.items() if not (own_head and name.startswith(embedding)))


@dataclass(frozen=True, slots=True)
class MachinePeaks:
    cores: int
    numerics: str  # the instruction the peak is of: amx_bf16, bf16 or fp32
    core_peak_gops: float  # one core's multiply-add peak alone, 2 ops each
    peak_gops: float  # every core's at once, summed: the machine's
    read_gb_s: float  # memory read bandwidth, every core

    @classmethod
    def measure(cls, cores: int, buffer_bytes: int = READ_BUFFER_BYTES) -> MachinePeaks | None:
        """None without the native kernels (nothing to measure the peak with)."""
        from shared.engine import native

        kernels = native.load()
        if kernels is None:
            return None
        numerics = kernel_numerics(kernels, "bf16")
        return cls(
            cores,
            numerics,
            kernels.core_peak_gops(numerics, PEAK_ITERATIONS),
            all_cores_peak(kernels.core_peak_gops, numerics, cores),
            read_bandwidth(cores, buffer_bytes),
        )

    def line(self) -> str:
        return (
            f"machine: {self.cores} cores, {self.numerics} multiply-add peak "
            f"{self.core_peak_gops:.0f} Gop/s on one core alone, {self.peak_gops:.0f} on all "
            f"{self.cores} at once; memory read {self.read_gb_s:.1f} GB/s"
        )


def kernel_numerics(kernels: ModuleType, numerics: str) -> str:
    """The instruction whose peak (core_peak_gops) a kernel of `numerics` weights is held to:
    bf16 and int8 weights run on AMX tiles where they run (amx_bf16, amx_int8); else bf16 as
    dot products with AVX512-BF16 (bf16), or widened in the fp32 FMA chain (fp32)."""
    if numerics in ("bf16", "int8") and kernels.amx_tiles() == "on":
        return f"amx_{numerics}"
    if numerics == "bf16" and not kernels.bf16_dot_product_kernel():
        return "fp32"
    return numerics


def all_cores_peak(
    core_peak: Callable[[str, int], float], numerics: str, cores: int, passes: int = 3
) -> float:
    """The best of `passes` runs of `_at_once` (the CI machine class's second vCPU is now and
    then busy elsewhere: one pass in six gave 240 Gop/s where the others gave 461-465)."""
    return max(_at_once(core_peak, numerics, cores) for _ in range(passes))


def _at_once(core_peak: Callable[[str, int], float], numerics: str, cores: int) -> float:
    """The sum of `cores` threads' multiply-add rates, all started together (the kernel
    releases the GIL), each long enough that the start matters little."""
    start = threading.Barrier(cores)
    rates = [0.0] * cores

    def run(i: int) -> None:
        start.wait()
        rates[i] = core_peak(numerics, PEAK_ITERATIONS)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(cores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(rates)


def read_bandwidth(threads: int, buffer_bytes: int, passes: int = 5) -> float:
    """GB/s of torch's sum over `buffer_bytes` of fp32 on `threads` threads: the best pass."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(buffer_bytes // 4)
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return buffer_bytes / best / 1e9
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True, slots=True)
class ServerFigures:
    """One server's medians, and its requests' mean size (the server's own usage counts)."""

    prompt_len: float
    output_len: float
    output_tok_s: float | None = None  # at the highest concurrency
    tpot_ms: float | None = None  # at the lowest
    offline_tok_s: float | None = None  # 64 x 128 -> 128 by default
    offline_lens: tuple[int, int] = (128, 128)  # prompt and output tokens offline


def shares(figures: ServerFigures, work: ModelWork, machine: MachinePeaks) -> dict[str, float]:
    """Each figure as the rate it implies and as a fraction of the machine's."""
    out: dict[str, float] = {}

    def multiply_adds(name: str, tok_s: float, prompt_len: float, output_len: float) -> None:
        out[f"{name}_gops"] = tok_s * work.ops_per_output_token(prompt_len, output_len) / 1e9
        out[f"{name}_of_peak"] = out[f"{name}_gops"] / machine.peak_gops

    if figures.output_tok_s:
        multiply_adds("serve", figures.output_tok_s, figures.prompt_len, figures.output_len)
    if figures.tpot_ms:
        context = figures.prompt_len + figures.output_len / 2
        out["decode_gb_s"] = work.decode_step_bytes(context) / (figures.tpot_ms / 1e3) / 1e9
        out["decode_of_bandwidth"] = out["decode_gb_s"] / machine.read_gb_s
    if figures.offline_tok_s:
        multiply_adds("offline", figures.offline_tok_s, *figures.offline_lens)
    return out


def format_shares(
    by_server: dict[str, dict[str, float]], machine: MachinePeaks, concurrencies: tuple[int, ...]
) -> str:
    """A table: per figure, per server, the rate it implies (its share of the machine's)."""
    servers = list(by_server)
    rows = (  # (label, rate key, fraction key, unit)
        (f"c={max(concurrencies)} output tok/s as multiply-adds (of the peak)", "serve_gops",
         "serve_of_peak", "Gop/s"),
        (f"c={min(concurrencies)} TPOT as reads (of the bandwidth)", "decode_gb_s",
         "decode_of_bandwidth", "GB/s"),
        ("offline output tok/s as multiply-adds (of the peak)", "offline_gops",
         "offline_of_peak", "Gop/s"),
    )  # fmt: skip
    lines = [
        machine.line(),
        "| share of the machine | " + " | ".join(servers) + " |",
        "|" + "---|" * (len(servers) + 1),
    ]
    for label, rate, fraction, unit in rows:
        cells = [
            f"{by_server[s][rate]:.1f} {unit} ({by_server[s][fraction]:.0%})"
            if rate in by_server[s]
            else "-"
            for s in servers
        ]
        if any(cell != "-" for cell in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
