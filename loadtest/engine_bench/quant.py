"""`splitserve bench quant`: accuracy and speed of each weight format (fp32, bf16, int8, int4,
w8a8, and gguf: a checkpoint kept quantized at pull), each named with the activation dtype
it runs in.

(a) perplexity on a fixed public-domain text (shared/models/data/perplexity.txt), in
    independent windows of `window` tokens (`llama_windows`: scored as `llama-perplexity -c
    512` scores it, whole windows only, each one's second half given its first; `ppl_only`:
    this alone, each format's row printed as soon as it is known);
(b) greedy agreement with fp32 over 20 chat prompts: mean common-prefix fraction of
    `agree_tokens` new tokens, and how many prompts are identical throughout;
(c) single-stream decode tok/s, beside the memory-bandwidth bound of the bytes a step reads,
    and the output tok/s of `batch` streams at once (128 prompt tokens each, prefill included):
    where a format pays, one stream (bytes) or many (multiply-adds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from loadtest.engine_bench.engine import engine_offline, engine_single_stream, random_prompts
from shared.engine.attention.metadata import AttentionMetadata, PrefillChunk
from shared.engine.engine import LLMEngine
from shared.engine.engine_config import EngineConfig
from shared.engine.quantization import int8_dot_product, weight_bytes
from shared.engine.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[2] / "shared" / "models" / "data" / "perplexity.txt"
BANDWIDTH = 26.6e9  # bytes/s read, 2 threads (ANCHORS.md)
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Name three primary colors.",
    "How do airplanes stay in the air?",
    "Give me a tip for learning a new language.",
    "What is the boiling point of water at sea level?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "Who wrote Romeo and Juliet?",
    "What are the benefits of regular exercise?",
    "Describe a cat in one sentence.",
    "What is the difference between weather and climate?",
    "List the planets of the solar system.",
    "How many days are in a leap year?",
    "What does a CPU do?",
    "Suggest a name for a bakery.",
    "What is the largest ocean on Earth?",
]


@dataclass(slots=True, frozen=True)
class QuantBenchConfig:
    model_dir: Path
    formats: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "w8a8")
    window: int = 512
    agree_tokens: int = 32
    stream_tokens: int = 64
    batch: int = 16
    batch_tokens: int = 32
    num_threads: int | None = None
    llama_windows: bool = False
    ppl_only: bool = False  # each format's perplexity alone (no agreement, no speed runs)


def perplexity(engine: LLMEngine, tokens: list[int], window: int, first: int = 0) -> float:
    """exp(mean NLL) of each token given the earlier ones in its window (engine left idle).
    first > 0: only the tokens after position `first` of each window are scored, and whole
    windows only (llama-perplexity's way, with first = window / 2)."""
    runner, bs = engine.runner, engine.config.block_size
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        ids = torch.tensor(tokens[start : start + window])  # [W]
        w = ids.shape[0]
        if w < 2 or (first and w < window):
            break
        blocks = torch.arange(-(-w // bs))  # the idle engine's first blocks, scratch space
        meta = AttentionMetadata(
            slot_mapping=torch.arange(w),
            num_decodes=0,
            decode_block_tables=torch.zeros(0, 0, dtype=torch.int64),
            decode_mask=None,
            prefills=[PrefillChunk(0, w, w, blocks)],
        )
        logits = runner.model.forward(
            ids, torch.arange(w), meta, runner.kv_cache.layers, torch.arange(first, w - 1)
        )  # [W - 1 - first, V]
        logprobs = torch.log_softmax(logits[:, : runner.sampler.vocab_size], dim=-1)
        nll -= logprobs.gather(1, ids[first + 1 :, None]).sum().item()
        count += w - 1 - first
    return math.exp(nll / count)


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"agree-{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"agree-{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[f"agree-{i}"] for i in range(len(prompts))]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    """Mean fraction of tokens before the first divergence, and the count of identical outputs."""
    fractions, identical = [], 0
    for ref, out in zip(reference, other, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, out, strict=True)) if a != b), len(ref))
        fractions.append(same / len(ref))
        identical += same == len(ref)
    return sum(fractions) / len(fractions), identical


def chat_prompts(model_dir: Path) -> list[list[int]]:
    return encode_chat(model_dir, QUESTIONS)


def encode_chat(model_dir: Path, messages: list[str]) -> list[list[int]]:
    """Token ids of one user message each, in the model's chat template."""
    from tokenizers import Tokenizer

    from shared.models.chat_template import load_chat_template, load_special_tokens, render_chat

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template, special = load_chat_template(model_dir), load_special_tokens(model_dir)
    texts = [render_chat(template, [{"role": "user", "content": q}], **special) for q in messages]
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]


# format: (dtype, quantization); the quantized ones are made from fp32 weights, but gguf:
# the checkpoint's own quantization (pulled with --keep-quant), its vectors and KV as auto
# picks; gguf-int8: the same, its activations quantized to int8 (--group-quant-activations)
FORMATS = {
    "gguf": ("auto", None),
    "gguf-int8": ("auto", None),
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "w8a8": ("float32", "w8a8"),
}


def run_quant_bench(cfg: QuantBenchConfig) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(cfg.model_dir / "tokenizer.json"))
    text_tokens = tokenizer.encode(TEXT.read_text(), add_special_tokens=False).ids
    prompts = chat_prompts(cfg.model_dir)
    first = cfg.window // 2 if cfg.llama_windows else 0
    scored = "second halves, as llama-perplexity" if first else "all"
    print(f"model {cfg.model_dir}; text {TEXT.name}: {len(text_tokens)} tokens")
    print(f"perplexity: windows of {cfg.window} tokens, {scored} scored")
    print(
        f"{'format':8} {'MB/step':>8} {'ppl':>8} {'agree':>7} {'identical':>10} "
        f"{'tok/s':>7} {'bound':>7} {f'x{cfg.batch} tok/s':>11}"
    )
    reference: list[list[int]] | None = None
    for fmt in cfg.formats:
        dtype, quantization = FORMATS[fmt]
        if quantization == "w8a8" and not int8_dot_product():
            print(f"{fmt:8} skipped: the C++ kernels have no AVX512-VNNI W8A8 kernel here")
            continue
        engine = LLMEngine(
            EngineConfig(
                model_dir=cfg.model_dir,
                device="cpu",  # int8/int4 are CPU kernels; the windows are CPU tensors
                dtype=dtype,
                quantization=quantization,
                num_kv_blocks=512,
                num_threads=cfg.num_threads,
                group_quant_activations="int8" if fmt == "gguf-int8" else "float",
            )
        )
        nbytes = weight_bytes(engine.runner.model.weights)
        ppl = perplexity(engine, text_tokens, cfg.window, first)
        if cfg.ppl_only:
            print(f"{fmt:8} {nbytes / 1e6:8.1f} {ppl:8.4f}", flush=True)
            continue
        outs = greedy_outputs(engine, prompts, cfg.agree_tokens)
        reference = reference or outs
        agree, identical = agreement(reference, outs)
        stream = random_prompts(1, 128, engine.model_config.vocab_size)[0]
        engine_single_stream(engine, stream[:16], 8)  # warm-up
        tok_s = engine_single_stream(engine, stream, cfg.stream_tokens)
        batch = random_prompts(cfg.batch, 128, engine.model_config.vocab_size, seed=1)
        batch_tok_s = engine_offline(engine, batch, cfg.batch_tokens)
        print(
            f"{fmt:8} {nbytes / 1e6:8.1f} {ppl:8.3f} {agree:7.3f} {identical:7d}/20 "
            f"{tok_s:7.1f} {BANDWIDTH / nbytes:7.1f} {batch_tok_s:11.1f}"
        )
    print("llama.cpp tg128 on this machine class (ANCHORS.md): Q8_0 92.3, Q4_1 115.9, F32 47.8")
