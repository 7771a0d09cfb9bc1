"""`WorkerConfig`: every setting of one worker process, checked at construction.

The engine's settings are one nested `EngineConfig` (`engine`); `engine_config()` is what
this worker's role runs. The settings every service shares are another (`common`). The
fields declared with `flag(...)` are the worker's own flags (`shared/flags.py`); the
engine's are declared in `EngineConfig`, the shared ones in `CommonConfig`. `cpus` pins the
worker to its own cores (services/worker/pinning.py): its engine then runs one torch thread
per core unless `--num-threads` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from services.worker.pinning import parse_cpus
from shared.config import CommonConfig
from shared.engine.engine_config import EngineConfig
from shared.errors import ConfigError
from shared.flags import flag
from shared.protocol import ROLES

KV_TRANSPORTS = ("auto", "nixl", "nats")
ENGINES = ("native", "vllm")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    worker_id: str = flag(unset="", help="default: role + a short random id")
    role: str = flag(
        unset="both",
        choices=ROLES,
        help="prefill, decode or both: the initial role (`splitserve role` changes it)",
    )
    role_change_timeout: float = flag(
        60.0,
        help="seconds a role change lets the dropped role's requests finish; past them, "
        "its running streams are failed so that their gateways migrate them",
    )
    model_name: str = flag(unset="", help="reported in heartbeats; default: the dir's name")
    kv_transport: str = flag(
        "auto",
        choices=KV_TRANSPORTS,
        help="how KV blocks move between workers: nixl (READ straight from the prefill "
        "worker's cache), nats (chunks in messages), auto (nixl where it loads, else nats)",
    )
    engine_kind: str = flag(
        "native",
        name="--engine",
        choices=ENGINES,
        help="native (our engine) or vllm (vLLM's async engine in-process; KV moves through "
        "vLLM's NIXL connector; see docs/vllm.md)",
    )
    vllm_side_channel_host: str = flag(
        "",
        help="--engine vllm: where peers reach this worker's NIXL side channel "
        "(default: this host's name resolved, a container's or pod's own address)",
    )
    vllm_side_channel_port: int = flag(
        0, help="--engine vllm: the port of this worker's NIXL side channel (0: a free one)"
    )
    vllm_compile: bool = flag(
        True,
        help="--engine vllm: torch.compile the model (minutes at the first start, cached under "
        "$SPLITSERVE_HOME/vllm and loaded at the next); --no-vllm-compile runs it eagerly, "
        "with no compile at any start",
    )
    cpus: str = flag(
        "",
        help="pin this worker to these cores (0, 0-1, 0,2) with one torch thread each and "
        "no core lease ('': unpinned, the cores shared with the machine's other workers)",
    )
    kv_peer_read_timeout: float = flag(
        1.0,
        help="seconds a read of prefix blocks from another worker may take, pin to READ's "
        "end (the scheduler's --kv-peer-reads hint); past them the prompt is computed",
    )
    engine: EngineConfig  # the model and every engine setting
    # NATS URL, credentials (the worker role's), namespace, log level, trace export
    common: CommonConfig = field(default_factory=CommonConfig)
    heartbeat_interval: float = 1.0  # seconds between heartbeats (and KV event checks)
    transfer_timeout: float = 30.0  # seconds one KV transfer may take at most
    # A decode reservation waits this long for its first KV chunk (the prefill may queue),
    # then `transfer_timeout` after each chunk; past that its blocks are freed.
    reservation_timeout: float = 120.0
    kv_window: int = 4  # KV chunks in flight, unacknowledged
    kv_headroom: int = 64 * 1024  # bytes left under max_payload for a chunk's other fields
    grace_period: float = 30.0  # seconds in-flight work may take after SIGTERM
    metrics_port: int | None = None  # Prometheus /metrics; 0: a free port; None: not served

    def __post_init__(self) -> None:
        parse_cpus(self.cpus)  # its syntax; the machine's cores are checked when it pins
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.engine_kind not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, not {self.engine_kind!r}")
        if self.engine_kind == "vllm":
            _check_vllm(self)
        if self.kv_window < 1:
            raise ConfigError("kv_window must be positive")
        if min(self.heartbeat_interval, self.transfer_timeout, self.reservation_timeout) <= 0:
            raise ConfigError(
                "heartbeat_interval, transfer_timeout and reservation_timeout must be positive"
            )
        if self.kv_peer_read_timeout <= 0:
            raise ConfigError("--kv-peer-read-timeout must be positive")
        if self.role_change_timeout < 0:
            raise ConfigError("--role-change-timeout must not be negative")

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    @property
    def pinned_cpus(self) -> tuple[int, ...]:
        return parse_cpus(self.cpus)

    @property
    def prefills(self) -> bool:
        return role_takes(self.role, decodes=False)

    @property
    def decodes(self) -> bool:
        return role_takes(self.role, decodes=True)

    def engine_config(self) -> EngineConfig:
        """The engine this role runs: block hashes name the model, only a decoding role
        speculates (a prefill worker never loads a draft model), and a pinned worker runs a
        thread per core (a thread count turns the core lease off)."""
        speculates = self.decodes and self.engine.speculative is not None
        threads = self.engine.num_threads
        if threads is None and self.cpus:
            threads = len(self.pinned_cpus)
        return replace(
            self.engine,
            model_id=self.model_name,
            num_threads=threads,
            speculative=self.engine.speculative if speculates else None,
            draft_model_dir=self.engine.draft_model_dir if speculates else None,
        )


def role_takes(role: str, decodes: bool) -> bool:
    """Does `role` take the decode side's work (`decodes`), or else the prefill side's?"""
    return role in (("decode", "both") if decodes else ("prefill", "both"))


def _check_vllm(config: WorkerConfig) -> None:
    """What a vLLM worker cannot take (ConfigError naming the flag)."""
    if config.kv_transport == "nats":
        raise ConfigError(
            "--engine vllm moves KV by vLLM's NIXL connector, not --kv-transport nats"
        )
    engine = config.engine
    unsupported = {
        "--quantization": engine.quantization is not None,
        "--group-quant-activations": engine.group_quant_activations != "auto",
        "--speculative": engine.speculative is not None,
        "--num-kv-blocks": engine.num_kv_blocks is not None,
        "--batch-invariant": engine.batch_invariant is True,
        "--kv-offloading-size": bool(engine.kv_offloading_size),  # our tier; vLLM has its own
    }
    for name, given in unsupported.items():
        if given:
            raise ConfigError(f"{name} is a native engine option: not with --engine vllm")
    if engine.device.startswith("cuda:"):
        raise ConfigError(
            f"--device {engine.device}: a vLLM worker runs on the GPUs CUDA_VISIBLE_DEVICES "
            "shows it; pass --device cuda (or auto) and set CUDA_VISIBLE_DEVICES"
        )
