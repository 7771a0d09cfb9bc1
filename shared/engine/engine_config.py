"""Engine settings: batch limits, KV cache size and numerics, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model_dir: Path
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_gib: float = 2.0  # memory for the paged KV cache; sets the number of blocks
    num_kv_blocks: int | None = None  # overrides kv_cache_gib when set
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # sequences running at once
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | torch | cpu | triton (auto: cpu when built)
    model_id: str = ""  # mixed into block hashes so two models never share cache entries
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    quantization: str | None = None  # None | int8 (per channel) | int4 (groups of 32)
    speculative: str | None = None  # None | ngram (prompt lookup; greedy-identical, lossless)
    num_speculative_tokens: int = 4  # draft tokens proposed per decode step

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be int8, int4 or None, not {self.quantization!r}")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"speculative must be ngram or None, not {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
