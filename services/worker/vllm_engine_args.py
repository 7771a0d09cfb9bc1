"""A vLLM worker's settings as vLLM's engine arguments and environment.

Every vLLM worker runs vLLM's NixlConnector (`kv_both`: it may send and receive KV), with
its KV buffer where the model runs, vLLM's own stats on (heartbeats read them) and its KV
cache events published where the worker subscribes (vllm_kv_subscriber.py).

The block size follows vLLM's attention on the device: unset (0), the smallest its backend
takes (32 on a CPU, 16 on a GPU); a given one that the CPU backend cannot run is refused
here, with the backend's own terms, before any engine process starts (ConfigError: the
worker exits as unable to run, and `up` stops rather than restart it).
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace

from vllm.config import KVTransferConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from services.worker.config import WorkerConfig
from services.worker.vllm_compile_cache import COMPILE_CACHE_ENV
from services.worker.vllm_lora import lora_engine_args
from services.worker.vllm_nixl_plugin import QUIET_NIXL_ENV
from services.worker.vllm_sleep import sleep_mode_available
from shared.engine.engine_config import EngineConfig
from shared.engine.model.checkpoint import gguf_kept_formats
from shared.engine.resolve import resolve
from shared.errors import ConfigError
from shared.models.pull import default_home
from shared.models.wna16_config import FP8_FORMATS, QuantFormat, Wna16Config, read_config
from shared.ports import free_port

GIB = 1 << 30
VLLM_CACHE = "vllm"  # under $SPLITSERVE_HOME: vLLM's caches, its compiled graphs among them
GPU_BLOCK_SIZE = 16  # what vLLM's GPU attention backends all take


def vllm_engine_config(config: WorkerConfig) -> EngineConfig:
    """The worker's engine settings with the block size vLLM runs on its device (this
    probes the device when it is `auto`). ConfigError for a size vLLM's CPU attention
    cannot run, and for a checkpoint vLLM cannot load or run there."""
    engine = config.engine_config()
    _refuse_checkpoint(engine)
    if engine.torch_device.type != "cpu":
        return replace(engine, block_size=engine.block_size or GPU_BLOCK_SIZE)
    sizes = CPUAttentionBackend.get_supported_kernel_block_sizes()
    if not engine.block_size:
        return replace(engine, block_size=min(_smallest(size) for size in sizes))
    if not any(_takes(size, engine.block_size) for size in sizes):
        raise ConfigError(
            f"--block-size {engine.block_size}: vLLM's CPU attention runs blocks of {sizes} "
            "tokens (leave --block-size unset for its own)"
        )
    return engine


def _refuse_checkpoint(engine: EngineConfig) -> None:
    """ConfigError, before vLLM starts, for a checkpoint vLLM cannot load or run here."""
    kept = gguf_kept_formats(engine.model_dir)
    if kept:
        raise ConfigError(
            f"{engine.model_dir} keeps GGUF {', '.join(kept)} in splitserve's own layout "
            "(as splitserve pull leaves it), which vLLM cannot load: serve it with the native "
            "engine, or pull a float copy (splitserve pull --no-keep-quant; splitserve up "
            "--engine vllm --model NAME pulls that one)"
        )
    quant = _quant_config(engine.model_dir)
    if quant is None:
        return
    if quant.format == QuantFormat.FP8 and quant.group and quant.block_rows == 1:
        raise ConfigError(
            f"{engine.model_dir} holds FP8 weights with group scales ({quant.label}), for "
            "which vLLM has no compressed-tensors scheme: serve it with the native engine"
        )
    if engine.torch_device.type != "cpu":
        return
    if quant.format in FP8_FORMATS and quant.per_tensor:
        raise ConfigError(
            f"{engine.model_dir} holds FP8 weights with one scale per tensor ({quant.label}), "
            "which vLLM's CPU build cannot run (it lacks static_scaled_fp8_quant): serve it "
            "with the native engine, or on a GPU"
        )
    if engine.dtype == "float32" and quant.format == QuantFormat.INT8:
        raise ConfigError(
            f"{engine.model_dir} is a W8A8 checkpoint (compressed-tensors int-quantized): "
            "vLLM's CPU int8 kernels take bf16 or fp16 activations, not --dtype float32 "
            "(leave --dtype auto, or serve it with the native engine)"
        )


def _quant_config(model_dir) -> Wna16Config | None:
    """The checkpoint's quantization_config as we read it; None for a float one and for one we
    do not read (vLLM's to judge)."""
    try:
        return read_config(model_dir)
    except ConfigError:
        return None


def _smallest(size: int | MultipleOf) -> int:
    return size.base if isinstance(size, MultipleOf) else size


def _takes(size: int | MultipleOf, block_size: int) -> bool:
    return block_size % size.base == 0 if isinstance(size, MultipleOf) else block_size == size


def engine_args(config: WorkerConfig, kv_events: KVEventsConfig) -> AsyncEngineArgs:
    engine = resolve(vllm_engine_config(config))
    connector = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        kv_buffer_device=engine.torch_device.type,  # device auto resolved: cuda or cpu
        # Held blocks no decode engine READs (it died, the request was cancelled) are freed
        # after this lease, which the reading engine extends while it READs.
        kv_connector_extra_config={"kv_lease_duration": max(1, round(config.transfer_timeout))},
    )
    return AsyncEngineArgs(
        model=str(engine.model_dir),
        served_model_name=[config.model_name],
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        enable_prefix_caching=engine.enable_prefix_caching,
        kv_cache_memory_bytes=int(engine.kv_cache_gib * GIB),
        kv_transfer_config=connector,
        kv_events_config=kv_events,
        enforce_eager=not config.vllm_compile,
        enable_sleep_mode=sleep_mode_available(engine.torch_device.type),
        disable_log_stats=False,
        seed=0,
        **lora_engine_args(engine),
    )


def set_environment(config: WorkerConfig) -> None:
    """What vLLM reads from the environment, for the engine core process it starts."""
    os.environ[QUIET_NIXL_ENV] = "1"  # no NIXL thread spinning on a core (vllm_nixl_plugin)
    os.environ[COMPILE_CACHE_ENV] = "1"  # the next start loads what this one compiles
    os.environ.setdefault("VLLM_CACHE_ROOT", str(default_home() / VLLM_CACHE))
    if config.engine.torch_device.type == "cpu":
        # The model runs in the engine core process, not in a third process of its own:
        # vLLM's CPU platform picks its multiprocess executor unless this is 0, and then
        # the engine core spins on sched_yield for each step's result (its shm_broadcast),
        # a core's worth beside the model on a small box. Our AsyncLLM still starts the
        # engine core as a process (its async client has no in-process mode).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # OpenMP threads on every core unless told, unbound: the engines of a box's workers
        # share its cores through the OS (docs/vllm.md, "Every core in each engine").
        threads = config.engine.num_threads or len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    host = config.vllm_side_channel_host or socket.gethostbyname(socket.gethostname())
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    port = config.vllm_side_channel_port or free_port(host)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
