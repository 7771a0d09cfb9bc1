"""What one `splitserve bench peers` run is asked to do (`PeersConfig`), and what a server of a
turn offers the run (`Server`): shared by the run (run.py) and what it prepares (prepare.py).

The one subtle rule: a config is checked whole when it is made (`plan_turns` refuses unknown
or repeated servers and a round count below 1), so a bad flag stops the run before any
server is set up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from loadtest.peers.figures import SERVERS, plan_turns
from loadtest.peers.offline import OfflineConfig
from shared.errors import ConfigError
from shared.models.registry import DEFAULT_MODEL

SERVER_START_TIMEOUT_S = 600.0  # vLLM's first start compiles its kernels (minutes)


@dataclass(frozen=True, slots=True)
class PeersConfig:
    model: str = DEFAULT_MODEL
    model_dir: Path | None = None
    servers: tuple[str, ...] = SERVERS
    rounds: int = 2
    concurrencies: tuple[int, ...] = (1, 16)
    num_prompts: int | None = None  # per run; None: max(8, 4 × concurrency)
    input_words: int = 100  # ≈ 128 prompt tokens
    output_len: int = 128
    up_args: tuple[str, ...] = ()  # extra flags for `splitserve up`, both of our meshes
    peers_venv: Path = Path(".venv-peers")
    vllm_kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    start_timeout_s: float = SERVER_START_TIMEOUT_S
    llama_build_timeout_s: float = 1800.0
    offline: OfflineConfig | None = field(default_factory=OfflineConfig)  # None: skip it
    out: Path = Path("artifacts/bench-peers")

    def __post_init__(self) -> None:
        plan_turns(self.servers, self.rounds)  # checks the names and the count
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ConfigError("concurrencies must be positive")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError("num_prompts must be positive")

    def prompts_at(self, concurrency: int) -> int:
        return self.num_prompts or max(8, 4 * concurrency)


class Server(Protocol):
    url: str

    def wait_ready(self, timeout_s: float) -> None: ...
    def stop(self) -> None: ...
