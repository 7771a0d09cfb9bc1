"""`splitserve bench gpu`: decode tokens/s and attention bandwidth on a CUDA device, each
against the HBM bandwidth measured on the spot.

- HBM: a large device-to-device copy, bytes read plus bytes written per second.
- decode: the engine (device cuda, bfloat16, Triton attention) on a random-weight model of
  Llama-3-8B's shapes, written as safetensors once (16 GB; `--weights-dir` keeps it for the
  next run). B greedy requests decode together; after every first token, the tokens of the
  remaining steps over their time (the second of two runs: the first compiles). The
  bound: B x HBM bandwidth over the bytes one step must read (every layer matrix and the
  head once, and each sequence's KV at the mean context).
- attention: the Triton decode kernels alone on B sequences of C context tokens (one
  layer's cache, blocks scattered), the K and V bytes they read over their time.
Targets (issue 9): batch-1 decode >= 80% of its bound; attention >= 70% of HBM at C >= 4k.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.engine.attention import get_backend
from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.quantization import weight_bytes
from shared.engine.sampling_params import SamplingParams

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
    "torch_dtype": "bfloat16",
}


@dataclass(slots=True, frozen=True)
class GpuBenchConfig:
    weights_dir: Path | None = None  # random Llama-3-8B weights: written here if missing
    batches: tuple[int, ...] = (1, 64)
    prompt_len: int = 128
    output_len: int = 128
    attention_batches: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (4096, 16384)
    block_size: int = 16
    kv_cache_gib: float = 16.0
    copy_gib: float = 4.0  # buffer of the HBM copy


def run_gpu_bench(cfg: GpuBenchConfig) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "splitserve bench gpu: no CUDA device (torch.cuda.is_available() is false)"
        )
    hbm = hbm_bandwidth(cfg.copy_gib)
    print(f"{torch.cuda.get_device_name()}: HBM {hbm / 1e9:.0f} GB/s (device-to-device copy)")
    print("attention, Triton decode kernels, bf16, Llama-3-8B's heads (32 over 8 KV, d 128):")
    print(f"{'batch':>5} {'context':>7} {'us':>9} {'GB/s':>7} {'of HBM':>7}")
    for batch in cfg.attention_batches:
        for context in cfg.contexts:
            seconds, nbytes = attention_time(batch, context, cfg.block_size)
            rate = nbytes / seconds  # bytes per second
            figures = f"{seconds * 1e6:>9.1f} {rate / 1e9:>7.0f} {rate / hbm:>7.1%}"
            print(f"{batch:>5} {context:>7} {figures}")
    print("target: >= 70% of HBM at context >= 4k")
    if cfg.weights_dir is None:
        with tempfile.TemporaryDirectory(prefix="llama3-8b-random-") as tmp:
            _decode_bench(cfg, write_random_llama(Path(tmp)), hbm)
    else:
        _decode_bench(cfg, write_random_llama(cfg.weights_dir), hbm)


def hbm_bandwidth(gib: float, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy of `gib` GiB (read once, written once)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * repeats / (start.elapsed_time(end) / 1e3)


def attention_time(
    batch: int, context: int, block_size: int, repeats: int = 20
) -> tuple[float, int]:
    """(seconds per call, bytes of K and V read) of the Triton decode attention."""
    c = LLAMA3_8B
    heads, kv_heads, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    cache = torch.randn(
        num_blocks, block_size, 2, kv_heads, d, dtype=torch.bfloat16, device="cuda"
    )  # [num_blocks, block_size, 2, kv_heads, d]
    tables = torch.randperm(num_blocks, device="cuda").view(batch, per_seq)  # [B, per_seq]
    width = per_seq * block_size
    mask = None
    if context != width:
        keys = torch.arange(width, device="cuda")
        mask = (keys < context).expand(batch, 1, 1, width).contiguous()  # [B, 1, 1, S]
    last = tables[:, (context - 1) // block_size]  # [B]
    meta = AttentionMetadata(
        slot_mapping=last * block_size + (context - 1) % block_size,
        num_decodes=batch,
        decode_block_tables=tables,
        decode_mask=mask,
        prefills=[],
    )
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")  # [B, heads, d]
    kv = torch.randn(batch, 2, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    attention = get_backend("triton", torch.device("cuda"))
    attention.attend(q, kv, cache, meta)  # compiles, and plans the step once
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        attention.attend(q, kv, cache, meta)
    end.record()
    end.synchronize()
    nbytes = batch * context * 2 * kv_heads * d * cache.element_size()
    return start.elapsed_time(end) / 1e3 / repeats, nbytes


def write_random_llama(path: Path, std: float = 0.02) -> Path:
    """An HF-layout Llama-3-8B of random bf16 weights at `path` (kept if already there): one
    safetensors file per layer, so the host holds one layer at a time."""
    if (path / "config.json").exists():
        return path
    c = LLAMA3_8B
    path.mkdir(parents=True, exist_ok=True)
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_out = c["num_attention_heads"] * c["head_dim"]
    kv_out = c["num_key_value_heads"] * c["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        w = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) * std
        return w.cpu()

    def ones() -> torch.Tensor:  # a tensor of its own: safetensors refuses shared memory
        return torch.ones(hidden, dtype=torch.bfloat16)

    save_file(
        {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": ones()},
        str(path / "embed.safetensors"),
    )
    save_file({"lm_head.weight": rand(vocab, hidden)}, str(path / "head.safetensors"))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {
            p + "input_layernorm.weight": ones(),
            p + "post_attention_layernorm.weight": ones(),
            p + "self_attn.q_proj.weight": rand(q_out, hidden),
            p + "self_attn.k_proj.weight": rand(kv_out, hidden),
            p + "self_attn.v_proj.weight": rand(kv_out, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_out),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
        save_file(layer, str(path / f"layer-{i:02d}.safetensors"))
    (path / "config.json").write_text(json.dumps(c, indent=2))  # last: marks it complete
    return path


def decode_tok_s(engine: LLMEngine, batch: int, prompt_len: int, output_len: int) -> float:
    """Output tokens per second of `batch` greedy requests, once every one has its first."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (prompt_len,)).tolist()
        engine.add_request(f"b{batch}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill
        started.update(out.request_id for out in engine.step())
    generated, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        generated += sum(len(out.new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


def _decode_bench(cfg: GpuBenchConfig, model_dir: Path, hbm: float) -> None:
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype="bfloat16",
            device="cuda",
            block_size=cfg.block_size,
            kv_cache_gib=cfg.kv_cache_gib,
            max_num_seqs=max(cfg.batches),
            max_num_batched_tokens=max(2048, max(cfg.batches)),
        )
    )
    c = engine.model_config
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2  # bf16 K and V
    weights = weight_bytes(engine.runner.model.weights)
    context = cfg.prompt_len + cfg.output_len // 2  # mean over the decode steps
    print(f"decode, engine on cuda, bf16, random Llama-3-8B ({weights / 1e9:.1f} GB streamed)")
    print(f"  prompt {cfg.prompt_len} -> {cfg.output_len} tokens; bound at context {context}")
    print(f"{'batch':>5} {'tok/s':>9} {'bound':>9} {'of bound':>8}")
    for batch in cfg.batches:
        # A first run compiles every specialization of the kernels these shapes reach.
        decode_tok_s(engine, batch, cfg.prompt_len, cfg.output_len)
        rate = decode_tok_s(engine, batch, cfg.prompt_len, cfg.output_len)
        bound = batch * hbm / (weights + batch * context * kv_per_token)
        print(f"{batch:>5} {rate:>9.1f} {bound:>9.1f} {rate / bound:>8.1%}")
    print("target: batch 1 >= 80% of its bound")
