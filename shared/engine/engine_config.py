"""Engine settings: batch limits, KV cache size and numerics, checked at construction.

Each field that a worker takes from its command line declares its flag here, once
(`shared/flags.py`): `splitserve worker`, `splitserve up` and the `SPLITSERVE_*` variables
of compose and Kubernetes all come from these declarations; `block_size_flag` is also the
scheduler's (it hashes blocks with the workers' size).

The subtle rule: an `EngineConfig` is pure. Making one never imports torch, probes the
hardware or builds kernels; its checks read only its own fields. `auto` (device, dtype,
batch_invariant; block size 0) stays `auto` until the engine is built:
shared/engine/resolve.py turns the config into one for this machine. `torch_dtype` and
`torch_device` import torch when read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.engine.lora.modules import parse_lora_modules
from shared.errors import ConfigError
from shared.flags import flag

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4", "w8a8")
SPECULATIVE_METHODS = ("ngram", "draft")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
CPU_TOKEN_BUDGET = 256  # the native engine's default step budget (max_num_batched_tokens)
GPU_TOKEN_BUDGET = 2048
NATIVE_BLOCK_SIZE = 16  # the native engine's block size when none is given
_DEVICE = re.compile(r"auto|(cpu|cuda)(:\d+)?")


def block_size_flag() -> Any:
    """The `--block-size` field, one declaration for the engine and the scheduler."""
    return flag(
        0,
        help="tokens per KV block, one size per model; 0: the engine's own (native 16; vLLM "
        "what its attention takes: 32 on a CPU), and the scheduler takes its workers'",
    )


def check_block_size(block_size: int) -> None:
    """A power of two, or 0 ("the engine's own": resolved when the engine is built)."""
    if block_size < 0 or block_size & (block_size - 1):
        raise ConfigError(f"block_size must be a power of two (or 0), not {block_size}")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model_dir: Path = flag(help="HF-layout model directory")
    # Weights and KV cache. auto: the checkpoint's own dtype on a GPU; on a CPU bfloat16
    # where the kernels have AVX512-BF16, or an AVX2 / AVX-512 path and run the matmuls, and
    # the weights are not quantized; else float32 (model_config.auto_dtype). On a CPU, bf16
    # weights keep an fp32 residual stream (batch_invariant.pack_weights): greedy text
    # agrees with fp32's more often than transformers' own bf16 does (docs/numerics.md).
    dtype: str = flag(
        "auto",
        choices=("auto", *DTYPE_NAMES),
        help="weights and KV cache; auto: the checkpoint's on a GPU, bf16 on a CPU with "
        "AVX512-BF16, or AVX2 and the C++ matmuls (unquantized), else float32",
    )
    # Where weights, KV cache and step tensors live: auto (cuda when torch sees a CUDA
    # device, else cpu) | cpu | cuda | cuda:N. On CUDA, attention auto resolves to triton.
    device: str = flag("auto", help="auto (cuda when torch sees a GPU, else cpu), cpu, cuda[:N]")
    block_size: int = block_size_flag()
    kv_cache_gib: float = flag(2.0, help="GiB for the paged KV cache; sets the block count")
    num_kv_blocks: int | None = flag(None, help="KV blocks; overrides --kv-cache-gib")
    # Unset: the engine's own budget (token_budget). The native engine takes 256 on a CPU:
    # prompts that arrive together are computed a few at a time, so first tokens (and
    # decode workers) do not wait for the whole group; 2048 on a GPU.
    # vLLM takes its own default (2048 for its server on a CPU).
    max_num_batched_tokens: int | None = flag(
        None,
        help="token budget of one step (prefill chunks + decodes); unset: the engine's "
        "(native: 256 on a CPU, 2048 on a GPU; vLLM: its own)",
    )
    max_num_seqs: int = flag(64, help="sequences running at once")
    max_model_len: int | None = flag(None, help="context length (default: the model's)")
    enable_prefix_caching: bool = flag(True, help="reuse the KV blocks of shared prefixes")
    # The second KV tier (shared/engine/kv_tier/): prefix blocks evicted from the cache are
    # kept there and loaded back when that is cheaper than recomputing them.
    # The flag's default (unset: None, the automatic size) is the services'; an engine made
    # in code has none unless asked.
    kv_offloading_size: float | None = flag(
        0.0,
        unset=None,
        help="GiB for the second KV tier of evicted prefix blocks (0: no tier; unset: on, "
        "2 GiB or a quarter of the directory's free space if less; vLLM: its own, none)",
    )
    kv_offloading_dir: str = flag(
        "", help="the second KV tier's directory ('': /dev/shm/splitserve-kv, else $TMPDIR)"
    )
    attention_backend: str = flag(
        "auto", choices=ATTENTION_BACKENDS, help="see shared/engine/attention/__init__.py"
    )
    # Every matmul batch-invariant (shared/engine/batch_invariant.py), so a row's logits do
    # not depend on the rest of its step. None (auto): on when the C++ kernels are built, the
    # weights are float (or w8a8) and attention is `cpu`; True insists.
    batch_invariant: bool | None = flag(
        None,
        help="batch-invariant matmuls, so seeded tokens survive migration "
        "(default: on when the C++ kernels are built and the weights are float)",
    )
    # The packed weights kept on disk and mapped at the next start (model/packed_cache.py)
    packed_cache: bool = flag(
        True,
        help="keep the weights packed for the CPU kernels under SPLITSERVE_HOME/packed and "
        "map them at the next start instead of packing again (rebuilt when stale)",
    )
    model_id: str = ""  # mixed into block hashes so two models never share cache entries
    # Unset: offline, torch's default; in a worker, the cores its machine's workers leave
    # idle (services/worker/core_lease.py).
    num_threads: int | None = flag(
        None, help="torch threads (unset: a worker borrows the cores idle workers leave)"
    )
    quantization: str | None = flag(
        None,
        choices=QUANTIZATIONS,
        help="at load: int8 per channel or int4 groups (weight-only), w8a8 (int8 weights and "
        "activations, AVX512-VNNI, batch-invariant)",
    )
    # A checkpoint kept quantized (GGUF, AWQ, GPTQ, compressed-tensors; model/group_quant.py):
    # float multiplies by its exact weights in fp32; int8 quantizes activations per block for
    # integer dot products (AVX512-VNNI or AVX2), as llama.cpp does: faster decoding, its
    # accuracy; auto: int8 for GGUF files (as llama.cpp runs them), float for the others (as
    # vLLM's W4A16 kernels run them)
    group_quant_activations: str = flag(
        "auto",
        choices=("auto", "float", "int8"),
        help="activations for weights kept quantized: float (exact sums), int8 (integer dots; "
        "AMX tiles for the GGUF formats where the CPU has them), or auto: int8 for GGUF files, "
        "float for AWQ, GPTQ and compressed-tensors",
    )
    # None | ngram (prompt lookup) | draft (a draft model); greedy-identical, lossless
    speculative: str | None = flag(
        None, choices=SPECULATIVE_METHODS, help="speculative decoding method"
    )
    num_speculative_tokens: int = flag(4, help="draft tokens proposed per decode step")
    draft_model_dir: Path | None = flag(
        None, name="--draft-model", help="--speculative draft: HF-layout dir, same vocabulary"
    )
    # LoRA adapters (shared/engine/lora/): on with enable_lora or any lora_modules
    enable_lora: bool = flag(False, help="serve LoRA adapters (on when --lora-modules names one)")
    lora_modules: tuple[str, ...] = flag(
        (),
        help="PEFT adapters served from the start: name=path … (the variable: comma-separated)",
        spaced=True,
    )
    max_loras: int = flag(4, help="LoRA adapters one step may use (slots the matmuls read)")
    max_lora_rank: int = flag(16, help="the highest LoRA rank accepted")
    max_cpu_loras: int | None = flag(
        None, help="LoRA adapters kept read in host memory (default: max_loras)"
    )

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise ConfigError(f"dtype must be one of {sorted(DTYPE_NAMES)}, not {self.dtype!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        cuda = self.device.startswith("cuda")
        if cuda and self.attention_backend == "cpu":
            raise ConfigError("the cpu attention backend reads CPU memory: not with device cuda")
        if cuda and (self.quantization or self.batch_invariant):
            raise ConfigError(
                "quantization and batch_invariant run CPU kernels: not with device cuda"
            )
        check_block_size(self.block_size)
        budget = self.max_num_batched_tokens
        if self.max_num_seqs < 1 or (budget is not None and budget < 1):
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be positive")
        known_budget = budget is not None or self.device != "auto"
        if known_budget and self.token_budget < self.max_num_seqs:
            raise ConfigError("max_num_batched_tokens must be >= max_num_seqs")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("num_kv_blocks must be positive")
        if self.kv_offloading_size is not None and self.kv_offloading_size < 0:
            raise ConfigError("kv_offloading_size must not be negative")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads must be positive")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(
                f"quantization must be int8, int4, w8a8 or None, not {self.quantization!r}"
            )
        if self.batch_invariant and self.quantization in ("int8", "int4"):
            raise ConfigError(
                "batch_invariant needs float or w8a8 weights (int8/int4 weight-only are not)"
            )
        if self.batch_invariant and self.attention_backend not in ("auto", "cpu"):
            raise ConfigError("batch_invariant needs the cpu attention backend (or auto)")
        if self.speculative not in (None, *SPECULATIVE_METHODS):
            raise ConfigError(f"speculative must be ngram, draft or None, not {self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model_dir is not None):
            raise ConfigError('speculative="draft" needs a draft_model_dir, and only it takes one')
        if self.num_speculative_tokens < 1:
            raise ConfigError("num_speculative_tokens must be positive")
        parse_lora_modules(self.lora_modules)
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError("max_loras and max_lora_rank must be positive")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError("max_cpu_loras must be >= max_loras")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def lora_host_slots(self) -> int:
        """Adapters kept read in host memory: max_cpu_loras, or max_loras when unset."""
        return self.max_cpu_loras or self.max_loras

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtypes()[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        """`device` resolved: auto picks cuda when a CUDA device is visible, else cpu."""
        return resolve_device(self.device)

    @property
    def token_budget(self) -> int:
        """The native engine's step budget: `max_num_batched_tokens`, or its default for the
        device (a resolved config's: `auto` counts as the CPU)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return GPU_TOKEN_BUDGET if self.device.startswith("cuda") else CPU_TOKEN_BUDGET


def torch_dtypes() -> dict[str, torch.dtype]:
    """Each of DTYPE_NAMES → its torch dtype (imports torch)."""
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda | cuda:N -> a device that exists here, or ConfigError saying why not."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, not {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} "
                "CUDA device(s)"
            )
        if device.index is None:  # bare cuda: the current device, named, so devices compare
            device = torch.device("cuda", torch.cuda.current_device())
    return device
